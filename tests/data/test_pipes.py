"""read_line over a real pipe: lines split at newlines, a timeout, the writer's end."""

import os

from jetrl.data.pipes import read_line


def test_lines_timeout_and_end_of_pipe():
  r, w = os.pipe()
  try:
    os.write(w, b"first\nsecond\npart")
    line, rest, closed = read_line(r, b"", 1.0)
    assert (line, rest, closed) == (b"first", b"second\npart", False)
    line, rest, closed = read_line(r, rest, 1.0)  # from the buffer alone
    assert (line, rest, closed) == (b"second", b"part", False)
    line, rest, closed = read_line(r, rest, 0.05)  # no newline comes: timeout
    assert (line, rest, closed) == (None, b"part", False)
    os.write(w, b"ial\n")
    assert read_line(r, rest, 1.0) == (b"partial", b"", False)
    os.close(w)
    w = None
    assert read_line(r, b"", 1.0) == (None, b"", True)
  finally:
    os.close(r)
    if w is not None:
      os.close(w)
