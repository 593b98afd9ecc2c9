"""Reading a worker process's replies: one line from a pipe, within a time limit."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional


def read_line(fd: int, buffer: bytes, timeout: float) -> tuple[Optional[bytes], bytes, bool]:
  """(line without its newline or None, the bytes left over, whether the pipe reached its end).

  Reads from file descriptor `fd` on top of `buffer` (what earlier reads left after their
  line) until a newline arrives, `timeout` seconds pass, or the writer closes its end."""
  deadline = time.monotonic() + timeout
  while b"\n" not in buffer:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      return None, buffer, False
    ready, _, _ = select.select([fd], [], [], remaining)
    if not ready:
      return None, buffer, False
    chunk = os.read(fd, 1 << 16)
    if not chunk:  # the writer closed its end: it is exiting
      return None, buffer, True
    buffer += chunk
  line, _, rest = buffer.partition(b"\n")
  return line, rest, False


def kill_worker(proc, *, group: bool = False, wait_s: float = 10.0) -> None:
  """Kill a worker process (and, with `group`, its whole process group: a worker started with
  `start_new_session` leaves nothing behind), reap it and close its pipes; never raises."""
  if proc is None:
    return
  try:
    if group:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    proc.kill()
    proc.wait(timeout=wait_s)
  except Exception:  # pylint: disable=broad-except
    pass
  for pipe in (proc.stdin, proc.stdout):
    try:
      if pipe is not None:
        pipe.close()
    except Exception:  # pylint: disable=broad-except
      pass


def spawn_confined(script: str) -> subprocess.Popen:
  """A worker running `script` in an isolated interpreter (`python -I -B`: no user site, no
  PYTHON* variables, no bytecode written), talking JSON lines over its stdin and stdout, its
  stderr discarded, no inherited descriptors, in `/`: what the parsing and template workers
  run as before they confine themselves further."""
  return subprocess.Popen(
    [sys.executable, "-I", "-B", script],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    bufsize=0,
    close_fds=True,
    cwd="/",
  )
