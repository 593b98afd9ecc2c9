"""The parent's side of the sympy worker (`sympy_worker.py`): asking it whether two normalised
answers are equal, within a time limit per comparison that no worker restart adds to.

Each request carries its time limit. The worker stops its own comparison when the limit is
near (an interval timer, `sympy_worker.py`) and answers "late", so a slow answer costs its
limit and no restart. A worker that does not answer by the limit (stuck in one C call) is
killed, and the spare worker, started beforehand, takes its place at once; a new spare starts
in the background. So one comparison costs at most its limit, restart included, and never
leaves the next one a worker to wait for (unless two die within one worker start-up, about a
second apart). The price is a second worker process (its memory) from the first comparison on.

Verdicts are cached per process; "no verdict" (late, no worker, no time) is not.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
import warnings

from jetrl.data.pipes import kill_worker, read_line, spawn_confined

STARTUP_TIMEOUT = 60.0
CACHE_SIZE = 65536
WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sympy_worker.py")
GRACE = 0.15  # seconds between the worker's own stop and the parent's kill (at most 1/4 limit)


def deadline_left(deadline: float | None) -> float:
  """Seconds until `deadline` (a time.monotonic() value; None: no deadline)."""
  return float("inf") if deadline is None else deadline - time.monotonic()


class _StartError(RuntimeError):
  """The worker did not start; `refused`: it said it cannot run confined (no retry)."""

  def __init__(self, message: str, refused: bool = False):
    super().__init__(message)
    self.refused = refused


class _Process:
  """One started worker process and the bytes read from it past its last line."""

  def __init__(self, path: str):
    self.proc = spawn_confined(path)
    self.owner = os.getpid()
    self.buffer = b""
    self.ready = False

  def read_line(self, timeout: float) -> tuple[bytes | None, bool]:
    """(the next line or None, whether the worker closed its end)."""
    line, self.buffer, closed = read_line(self.proc.stdout.fileno(), self.buffer, timeout)
    return line, closed

  def wait_ready(self, timeout: float) -> bool:
    """Whether the worker said it is ready (False: not within `timeout`); _StartError when it
    said it cannot run, or exited."""
    if not self.ready:
      line, closed = self.read_line(timeout)
      if line is None and not closed:
        return False
      reply = json.loads(line) if line is not None else {}
      if reply.get("ready") is not True:
        raise _StartError(reply.get("error", "it exited"), refused="error" in reply)
      self.ready = True
    return True

  def alive(self) -> bool:
    return self.owner == os.getpid() and self.proc.poll() is None

  def kill(self) -> None:
    if self.owner == os.getpid():  # only a worker this process started
      kill_worker(self.proc, wait_s=5)


class _Worker:
  """A long-lived, confined worker, and a spare started beforehand to replace it."""

  def __init__(self, path: str | None = None):
    self.path = path
    self.proc = None  # the worker's Popen (None: none started)
    self.current = None
    self.current_counted = False  # whether its start is in stats["restarts"]
    self.spare = None
    self.next_id = 0
    self.failed_starts = 0
    self.lock = threading.Lock()
    self.stats = {"requests": 0, "timeouts": 0, "restarts": 0, "over_budget": 0}

  def _spawn(self) -> _Process | None:
    try:
      return _Process(self.path or WORKER_PATH)
    except Exception:  # pylint: disable=broad-except
      return None

  def _failed(self, error: _StartError) -> None:
    self.failed_starts = 2 if error.refused else self.failed_starts + 1
    if self.failed_starts >= 2:
      warnings.warn(
        f"jetrl.data: the sympy worker could not start ({error}); symbolic answer "
        "comparison is off in this process",
        RuntimeWarning,
        stacklevel=4,
      )

  def _ready(self, deadline: float | None) -> bool:
    """Whether a worker is ready for a request, taking the spare or starting one if needed.
    A worker still starting when `deadline` comes is kept for the next request."""
    if self.current is not None and not self.current.alive():
      self._drop()
    while True:
      if self.current is None:
        if self.failed_starts >= 2:
          return False
        self.current, self.spare = self.spare or self._spawn(), None
        if self.current is None:
          self._failed(_StartError("it could not be spawned"))
          continue
      try:
        if self.current.wait_ready(max(0.0, min(STARTUP_TIMEOUT, deadline_left(deadline)))):
          break
        if deadline_left(deadline) <= 0:
          return False  # out of time: it goes on starting for the next request
        raise _StartError(f"no ready line in {STARTUP_TIMEOUT:.0f} s")
      except Exception as e:  # pylint: disable=broad-except
        self._drop()
        self._failed(e if isinstance(e, _StartError) else _StartError(repr(e)))
    if not self.current_counted:
      self.stats["restarts"] += 1
      self.current_counted = True
    self.proc = self.current.proc
    if self.spare is None or not self.spare.alive():
      self.spare = self._spawn()
    return True

  def _drop(self) -> None:
    current, self.current, self.proc = self.current, None, None
    self.current_counted = False
    if current is not None:
      current.kill()

  def ask(self, a: str, b: str, timeout: float, deadline: float | None) -> bool | None:
    """The worker's verdict, or None when there is none (late, no worker, no time left)."""
    with self.lock:
      if deadline_left(deadline) <= 0:
        self.stats["over_budget"] += 1
        return None
      if not self._ready(deadline):
        return None
      limit = min(timeout, deadline_left(deadline))
      if limit <= 0:
        self.stats["over_budget"] += 1
        return None
      self.stats["requests"] += 1
      self.next_id += 1
      rid = self.next_id
      own = max(0.01, limit - min(GRACE, limit / 4))  # the worker stops itself first
      try:
        request = {"id": rid, "a": a, "b": b, "limit": own}
        self.current.proc.stdin.write((json.dumps(request) + "\n").encode())
        line, _ = self.current.read_line(limit)
        reply = json.loads(line) if line is not None else None
        if reply is None or reply.get("id") != rid:
          self.stats["timeouts"] += reply is None
          self._drop()  # the spare takes over at the next request
          return None
        if reply.get("late"):
          self.stats["timeouts"] += 1
          return None
        return reply.get("eq") is True
      except Exception:  # pylint: disable=broad-except
        self._drop()
        return None

  def start(self, deadline: float | None = None) -> bool:
    """Starts the worker (and its spare) now, if it is not running; whether one is ready."""
    with self.lock:
      return self._ready(deadline)

  def close(self):
    with self.lock:
      self._drop()
      spare, self.spare = self.spare, None
      if spare is not None:
        spare.kill()


_WORKER = _Worker()
atexit.register(_WORKER.close)
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def symbolic_equal(a: str, b: str, timeout: float, *, deadline: float | None = None) -> bool:
  """sympy's verdict on normalised answers a and b, within `timeout` seconds and before
  `deadline` (False if none). Verdicts are cached per process; "no verdict" is not."""
  with _CACHE_LOCK:
    if (a, b) in _CACHE:
      _CACHE.move_to_end((a, b))
      return _CACHE[(a, b)]
  verdict = _WORKER.ask(a, b, float(timeout), deadline)
  if verdict is None:
    return False
  with _CACHE_LOCK:
    _CACHE[(a, b)] = verdict
    while len(_CACHE) > CACHE_SIZE:
      _CACHE.popitem(last=False)
  return verdict


def start_worker(deadline: float | None = None) -> bool:
  """Starts the worker now (a batch does so before it shares out its time)."""
  return _WORKER.start(deadline)


def count_over_budget() -> None:
  """Counts one comparison left out because its batch's time was spent."""
  with _WORKER.lock:
    _WORKER.stats["over_budget"] += 1


def worker_stats() -> dict:
  """Counts of sympy requests, timeouts (late answers and killed workers), (re)starts and
  comparisons refused for lack of time (over_budget) in this process."""
  return dict(_WORKER.stats)


def shutdown_worker() -> None:
  """Stops the sympy worker and its spare (a later comparison starts new ones)."""
  _WORKER.close()
