"""`jetrl.train.progress.ticking`: a long phase shows its elapsed time while it lasts (a line
every few seconds off a terminal, one line rewritten in place on a terminal) and how long it
took."""

import io
import re
import time

import pytest

from jetrl.train.progress import Ticker, ticking


def test_off_a_terminal_a_long_phase_prints_a_line_every_few_seconds_then_its_duration():
  lines = []
  with ticking("compiling the update", lines.append, tty=False, quiet_for=0.05, line_every=0.05):
    time.sleep(0.4)
  assert lines[0] == "compiling the update..."
  ticks = lines[1:-1]
  assert len(ticks) >= 2, lines
  assert all(re.fullmatch(r"  compiling the update: \ds elapsed, still running", t) for t in ticks)
  done = re.fullmatch(r"  compiling the update: done in (\d+\.\d)s", lines[-1])
  assert done and 0.3 < float(done.group(1)) < 5, lines


def test_on_a_terminal_one_line_is_rewritten_in_place_and_cleared():
  lines, screen = [], io.StringIO()
  ticker = Ticker("compiling", lines.append, stream=screen, tty=True, quiet_for=0.05)
  ticker.tty_every = ticker.every = 0.05
  ticker.start()
  time.sleep(0.3)
  ticker.line("  eval: 64/128 problems")  # a line of the phase: the clock's line cleared first
  time.sleep(0.2)
  ticker.stop()
  text = screen.getvalue()
  assert text.startswith("\r  compiling: 0s elapsed"), repr(text)
  assert "\n" not in text and text.endswith("\r" + " " * len("  compiling: 0s elapsed") + "\r")
  assert lines[0] == "compiling..." and lines[1] == "  eval: 64/128 problems"
  assert lines[2].startswith("  compiling: done in ") and len(lines) == 3


def test_a_short_phase_says_only_its_start_and_end_and_no_log_says_nothing():
  lines = []
  with ticking("compiling", lines.append, tty=False):  # quiet for the first 10 s
    pass
  assert lines[0] == "compiling..." and lines[1].startswith("  compiling: done in 0.")
  assert len(lines) == 2
  with ticking("compiling", None) as clock:
    assert clock is None
  with pytest.raises(KeyError):  # an error ends the clock without the closing line
    with ticking("compiling", lines.append, tty=False, report=True):
      raise KeyError("x")
  assert lines[2:] == ["compiling..."]
