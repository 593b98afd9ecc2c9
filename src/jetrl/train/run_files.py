"""Writing a run's files in its workdir without following links.

A workdir may be shared, or prepared by someone else: `<workdir>/.lock` or `config.json` as a
link to a user's file once had that file emptied or replaced by the run's config, and a `tb/`,
`plots/` or `checkpoints/` link sent the events, plots and checkpoints into its target. So a
workdir's tree is the run's own:

- `check_tree`, when a run takes its workdir (before it writes anything but its lock): no
  symbolic link anywhere under the workdir (but inside `wandb/`, where the wandb library
  keeps links of its own), nothing but plain files and folders, and no file
  of the workdir itself (where the run appends and rewrites) with a second hard link.
- Every file a run writes goes through these functions: a file is opened with `O_NOFOLLOW` (a
  link is refused with an error naming it; so is a file opened for writing that has another
  hard link), whole files are written to a fresh temporary file beside them and renamed over
  the old name (a rename replaces a link, never its target, so a reader sees the old file or
  the new one, never half of one), and every folder it writes in is made by `own_dir`, which
  refuses a link planted in its place.

A workdir that is itself a symbolic link is resolved once when the run starts, and the log says
so (`resolve_workdir`): the run then writes in the folder it points to, checked as above.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable

from jetrl.config import FlagError


def _refuse_link(path: str, e: OSError) -> None:
  if e.errno == errno.ELOOP or os.path.islink(path):
    raise FlagError(
      "workdir",
      f"{path!r} is a symbolic link; a run's workdir holds only its own files and folders, "
      "never links, so that nothing is written elsewhere (remove the link, or use another "
      "--workdir)",
    ) from None


def refuse_link(path: str) -> None:
  """FlagError (--workdir) when `path` is a symbolic link."""
  if os.path.islink(path):
    _refuse_link(path, OSError(errno.ELOOP, "a link"))


def _refuse_hard_link(path: str, links: int) -> None:
  raise FlagError(
    "workdir",
    f"{path!r} has {links} hard links (the same file is also elsewhere); a run writes only "
    "files of its own, so it would change the other copy too: replace it by a copy (cp "
    "FILE FILE.copy && mv FILE.copy FILE), or use another --workdir",
  )


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
  """`os.open(path, flags | O_NOFOLLOW)`; FlagError (--workdir) when `path` is a link, or when
  it is opened for writing and is not a plain file with one hard link."""
  try:
    fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
  except OSError as e:
    _refuse_link(path, e)
    raise
  if flags & (os.O_WRONLY | os.O_RDWR):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
      os.close(fd)
      if not stat.S_ISREG(st.st_mode):
        raise FlagError(
          "workdir", f"{path!r} is not a plain file; remove it, or use another --workdir"
        )
      _refuse_hard_link(path, st.st_nlink)
  return fd


def own_dir(path: str) -> str:
  """Creates the folder `path` (its parent must exist) unless it is there; FlagError
  (--workdir) when a link or a file is there instead. Returns `path`."""
  try:
    os.mkdir(path)
  except FileExistsError:
    pass
  st = os.lstat(path)
  if stat.S_ISLNK(st.st_mode):
    _refuse_link(path, OSError(errno.ELOOP, "a link"))
  if not stat.S_ISDIR(st.st_mode):
    raise FlagError("workdir", f"{path!r} is not a folder; remove it, or use another --workdir")
  return path


OWN_LINKS = "wandb"  # W&B's folder: the wandb library makes links of its own in it (latest-run)


def check_tree(workdir: str) -> None:
  """FlagError (--workdir) naming the first path under `workdir` that a run must not write
  through: a symbolic link (to a file or a folder) at any depth, anything but a plain file or
  folder (a FIFO would block a read), or a file directly in the workdir (the files a run
  appends to and rewrites) with more than one hard link. A `wandb` folder (the wandb library's
  own, which holds links it makes) must not be a link itself; what is in it is not checked."""
  todo = [workdir]
  while todo:
    folder = todo.pop()
    with os.scandir(folder) as entries:
      for entry in sorted(entries, key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
          _refuse_link(entry.path, OSError(errno.ELOOP, "a link"))
        elif stat.S_ISDIR(st.st_mode):
          if entry.name != OWN_LINKS:
            todo.append(entry.path)
        elif not stat.S_ISREG(st.st_mode):
          raise FlagError(
            "workdir",
            f"{entry.path!r} is not a plain file or folder; a run's workdir holds only its own "
            "files (remove it, or use another --workdir)",
          )
        elif folder == workdir and st.st_nlink > 1:
          _refuse_hard_link(entry.path, st.st_nlink)


def resolve_workdir(workdir: str, log: Callable[[str], None]) -> str:
  """`workdir`, or, when it is itself a symbolic link, the folder it points to (said in the
  log): a run writes in one real folder, whose tree `check_tree` checks."""
  if not os.path.islink(workdir.rstrip(os.sep) or workdir):  # `link/` is the link too
    return workdir
  real = os.path.realpath(workdir)
  log(f"--workdir {workdir} is a symbolic link to {real}: the run writes in {real}")
  return real


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
