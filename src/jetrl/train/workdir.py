"""One run per workdir, and earlier results never deleted.

`WorkdirLock`: a run holds `<workdir>/.lock` (an exclusive `flock`, with the holder's pid and
host written in it) from start to end. A second run in the same workdir is refused with a
message naming the holder, instead of interleaving its metric lines with the first's. The
kernel releases the lock when its holder dies, so a lock file left by a killed run is taken
over (the dead pid is named in a log line).

`start_fresh`: a workdir with metric records but no checkpoint to resume from is refused,
unless `--overwrite`; then, and for the few lines a run killed before its first checkpoint was
due leaves (judged by that run's own saved config), the old files are moved to
`<workdir>/previous/<time>/`: nothing is deleted.
See docs/reliability.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from typing import Callable, Optional, Sequence

from jetrl import parallel
from jetrl.train.run_files import check_tree, open_no_follow, own_dir
from jetrl.train.validation import FlagError
from jetrl.train.writers import read_jsonl

LOCK_NAME = ".lock"
PREVIOUS_DIR = "previous"


def pid_alive(pid: int) -> bool:
  """Whether process `pid` of this machine is running."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def make_workdir(workdir: str) -> None:
  """Creates the workdir; FlagError (--workdir) when that is impossible."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise FlagError("workdir", f"cannot create {workdir!r}: {e.strerror or e}") from None


class WorkdirLock:
  """An exclusive lock on a workdir, held by this process until `release()`."""

  def __init__(self, workdir: str, log: Callable[[str], None] = print):
    self.path = os.path.join(workdir, LOCK_NAME)
    self.fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)  # never a link's target
    try:
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      busy = False
    except OSError as e:
      if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        busy = True
      elif e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # no flock here: judge by the pid
        pid = self._pid()
        busy = (
          pid is not None
          and pid != os.getpid()
          and pid_alive(pid)
          and (self._text().split(" ")[1:2] in ([], [socket.gethostname()]))
        )
      else:
        os.close(self.fd)
        raise
    if busy:
      holder = self._holder()
      os.close(self.fd)
      self.fd = None
      raise FlagError(
        "workdir",
        f"{workdir!r} is in use by another run ({holder}); wait for "
        "it to finish, stop it, or use another --workdir",
      )
    previous = self._holder()
    pid = self._pid()
    if pid is not None and pid != os.getpid():
      state = "no longer running" if not pid_alive(pid) else "not holding it"
      log(f"taking over the lock of {previous} in {workdir} ({state})")
    os.ftruncate(self.fd, 0)
    os.pwrite(self.fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

  def _text(self) -> str:
    try:
      return os.pread(self.fd, 256, 0).decode(errors="replace").strip()
    except OSError:
      return ""

  def _pid(self):
    head = self._text().split(" ")[0]
    return int(head) if head.isdigit() else None

  def _holder(self) -> str:
    text = self._text().split(" ")
    if not text or not text[0].isdigit():
      return "holder unknown"
    return f"pid {text[0]}" + (f" on {text[1]}" if len(text) > 1 else "")

  def release(self) -> None:
    if self.fd is not None:
      os.ftruncate(self.fd, 0)
      try:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
      except OSError:
        pass
      os.close(self.fd)
      self.fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def take_workdir(workdir: str, log: Callable[[str], None] = print):
  """Creates and locks `workdir` for a run, and checks its tree (`run_files.check_tree`: no
  link, no hard-linked run file, before anything is written); the lock (None in the other
  processes).

  With several processes the primary alone takes the lock, for the whole run: the others
  write only their checkpoint shards, inside the run the lock protects. Its refusal (a
  workdir in use) stops every process with the same error (`jetrl.parallel.on_primary`)."""

  def take():
    make_workdir(workdir)
    lock = WorkdirLock(workdir, log)
    try:
      check_tree(workdir)  # before the run writes anything but its lock
    except BaseException:
      lock.release()
      raise
    return lock

  return parallel.on_primary(take)


def _steps(path: str) -> list[int]:
  if not os.path.exists(path):
    return []
  return [int(r.get("step", 0)) for r in read_jsonl(path)]


def earlier_first_checkpoint(workdir: str, config_file: Optional[str]) -> Optional[int]:
  """The step of the first checkpoint of the run whose config `config_file` in `workdir` was
  saved (min(checkpoint.every, steps)); None without a readable one."""
  if not config_file:
    return None
  try:
    with open(os.path.join(workdir, config_file), encoding="utf-8") as f:
      saved = json.load(f)
    every, steps = saved["checkpoint"]["every"], saved["steps"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (every, steps)):
    return None
  return min(every, steps)


def start_fresh(
  workdir: str,
  metric_files: Sequence[str],
  other_files: Sequence[str],
  *,
  first_checkpoint: int,
  overwrite: bool,
  log: Callable[[str], None] = print,
  move: bool = True,
  config_file: Optional[str] = None,
  summary_file: Optional[str] = None,
) -> None:
  """Prepare a workdir for a run from step 0 (called when it has no checkpoint).

  `metric_files` hold the step records; `other_files` are moved along with them (config,
  summary, plots, TensorBoard). Records before the earlier run's first checkpoint are what a
  run killed before that checkpoint leaves: they are moved aside. A record at or past it means
  a checkpoint was due and is gone (deleted, or the save was cut short): refused unless
  `overwrite`, which moves them aside too. The earlier run's first checkpoint is read from its
  saved config (`config_file` in the workdir: min(checkpoint.every, steps)); without one, this
  run's `first_checkpoint` stands in. A run writes a step's records before that step's
  checkpoint, so records that end exactly at that step are also what a run killed during its
  first save leaves; with `summary_file` (written when a run finishes) given, they count as
  such unless the summary is there. With `move=False` (the other processes of a multi-process
  run) only the decision is made.
  """
  steps = {name: _steps(os.path.join(workdir, name)) for name in metric_files}
  found = {name: s for name, s in steps.items() if s}
  if not found:
    return
  last = max(max(s) for s in found.values())
  earlier = earlier_first_checkpoint(workdir, config_file)
  due = earlier if earlier is not None else first_checkpoint
  finished = summary_file is None or os.path.exists(os.path.join(workdir, summary_file))
  was_due = last > due or (last == due and finished)
  if was_due and not overwrite:
    listing = ", ".join(
      f"{name} (steps {min(s)}..{max(s)}, {len(s)} records)" for name, s in found.items()
    )
    source = "" if earlier is None else f" (its {config_file})"
    raise FlagError(
      "workdir",
      f"{workdir!r} holds metrics of an earlier run ({listing}) but no "
      f"checkpoint to resume from, although its first checkpoint was due at step {due}"
      f"{source}; pass --overwrite to start afresh (the old "
      f"files are moved to {os.path.join(workdir, PREVIOUS_DIR)}/, not deleted), "
      "or use another --workdir",
    )
  if not move:
    return
  dest = move_aside(workdir, list(metric_files) + list(other_files))
  why = "--overwrite" if was_due else "no checkpoint was written"
  log(f"starting from step 0 ({why}): the earlier files are in {dest}")


def move_aside(workdir: str, names: Sequence[str]) -> str:
  """Moves the existing `names` of `workdir` into a new `previous/<time>` folder; its path."""
  stamp = time.strftime("%Y%m%d-%H%M%S")
  dest = os.path.join(workdir, PREVIOUS_DIR, stamp)
  k = 1
  while os.path.exists(dest):
    k += 1
    dest = os.path.join(workdir, PREVIOUS_DIR, f"{stamp}-{k}")
  own_dir(os.path.join(workdir, PREVIOUS_DIR))
  own_dir(dest)
  for name in names:
    src = os.path.join(workdir, name)
    if os.path.exists(src):
      shutil.move(src, os.path.join(dest, name))
  return dest
