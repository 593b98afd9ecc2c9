"""Reading a worker process's replies: one line from a pipe, within a time limit."""

from __future__ import annotations

import os
import select
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
