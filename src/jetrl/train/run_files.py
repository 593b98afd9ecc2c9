"""Writing a run's files in its workdir without following symbolic links.

A workdir may be shared, or prepared by someone else: `<workdir>/.lock` or `config.json` as a
link to a user's file once had that file emptied or replaced by the run's config. Every file
a run writes in its workdir goes through these functions: a file is opened with `O_NOFOLLOW`
(a link is refused with an error naming it), and whole files are written to a fresh temporary
file beside them and renamed over the old name (a rename replaces a link, never its target),
so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os

from jetrl.config import FlagError


def _refuse_link(path: str, e: OSError) -> None:
  if e.errno == errno.ELOOP or os.path.islink(path):
    raise FlagError(
      "workdir",
      f"{path!r} is a symbolic link; a run writes only plain files in its workdir (remove "
      "the link, or use another --workdir)",
    ) from None


def refuse_link(path: str) -> None:
  """FlagError (--workdir) when `path` is a symbolic link."""
  if os.path.islink(path):
    _refuse_link(path, OSError(errno.ELOOP, "a link"))


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
  """`os.open(path, flags | O_NOFOLLOW)`; FlagError (--workdir) when `path` is a link."""
  try:
    return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
  except OSError as e:
    _refuse_link(path, e)
    raise


def append_text(path: str, text: str) -> None:
  """Appends `text` to the file at `path` (created if missing), never through a link."""
  fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)


def write_atomic(path: str, text: str) -> None:
  """Replaces the file at `path` by one holding `text`: written to a new temporary file in
  the same directory, flushed, then renamed over `path` (a link there is replaced, its target
  untouched)."""
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    os.unlink(tmp)  # a leftover (or a planted link) of this name
  except FileNotFoundError:
    pass
  fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
