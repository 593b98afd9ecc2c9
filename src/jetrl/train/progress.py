"""A ticking clock for the long silent phases of a run: a compile, a first evaluation.

  with ticking("compiling the sampler (first step only)", log):
    out = sample(...)

says `compiling the sampler (first step only)...` when the phase starts; once it has lasted
`quiet_for` seconds (10), it shows the elapsed time while it goes on: on a terminal one line
rewritten in place every 2 s, otherwise (a log file, a pipe, a notebook) a line every 15 s;
when it ends, a line with how long it took (`report=False` leaves that to the caller's own
line). A phase shorter than `quiet_for` prints only its first and last lines. The per-step
line of a run (step/total, elapsed, ETA) is `jetrl.train.writers.Progress`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, Optional

QUIET_FOR = 10.0  # seconds before the clock starts to show
TTY_EVERY = 2.0  # a terminal's line is rewritten this often
LINE_EVERY = 15.0  # elsewhere, a line this often


def _is_tty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


def _clock_text(seconds: float) -> str:
  seconds = int(seconds)
  if seconds < 60:
    return f"{seconds}s"
  return f"{seconds // 60}m{seconds % 60:02d}s"


class Ticker:
  """The clock of one phase (see the module's doc); `start()`, then `stop()` -> seconds."""

  def __init__(
    self,
    what: str,
    log: Callable[[str], None] = print,
    *,
    report: bool = True,
    stream=None,
    tty: Optional[bool] = None,
    quiet_for: float = QUIET_FOR,
    tty_every: float = TTY_EVERY,
    line_every: float = LINE_EVERY,
    clock: Callable[[], float] = time.monotonic,
  ):
    self.what, self.log, self.report = what, log, report
    self.stream = stream or sys.stdout
    self.tty = _is_tty(self.stream) if tty is None else tty
    self.quiet_for, self.clock = quiet_for, clock
    self.every = tty_every if self.tty else line_every
    self._done = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._shown = 0  # the width of the terminal line written in place (0: none)
    self._lock = threading.Lock()
    self.t0 = 0.0

  def start(self) -> "Ticker":
    self.t0 = self.clock()
    self.log(f"{self.what}...")
    self._thread = threading.Thread(target=self._tick, name="jetrl-ticker", daemon=True)
    self._thread.start()
    return self

  def _tick(self) -> None:
    if self._done.wait(self.quiet_for):
      return
    while True:
      self.show(self.clock() - self.t0)
      if self._done.wait(self.every):
        return

  def show(self, elapsed: float) -> None:
    """One tick: the elapsed time, in place on a terminal, else as a line."""
    text = f"  {self.what.strip()}: {_clock_text(elapsed)} elapsed"
    with self._lock:
      if self._done.is_set():
        return
      if self.tty:
        pad = max(0, self._shown - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._shown = len(text)
      else:
        self.log(text + ", still running")

  def line(self, text: str) -> None:
    """`log(text)` during the phase, after clearing a terminal's line written in place."""
    with self._lock:
      self._clear()
    self.log(text)

  def _clear(self) -> None:
    if self._shown:
      self.stream.write("\r" + " " * self._shown + "\r")
      self.stream.flush()
      self._shown = 0

  def stop(self) -> float:
    """Ends the clock (its terminal line cleared); logs how long the phase took."""
    with self._lock:
      self._done.set()
      self._clear()
    if self._thread is not None:
      self._thread.join()
    seconds = self.clock() - self.t0
    if self.report:
      self.log(f"  {self.what.strip()}: done in {seconds:.1f}s")
    return seconds


@contextlib.contextmanager
def ticking(what: str, log: Optional[Callable[[str], None]], **kw) -> Iterator[Optional[Ticker]]:
  """A `Ticker` around the block (nothing at all when `log` is None). An exception ends the
  clock without the closing line."""
  if log is None:
    yield None
    return
  ticker = Ticker(what, log, **kw).start()
  try:
    yield ticker
  except BaseException:
    ticker.report = False
    ticker.stop()
    raise
  ticker.stop()
