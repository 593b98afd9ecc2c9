"""A user's reward function, named `path/to/file.py:fn` or `module:fn`, run with a time limit.

The function has the TRL shape, `fn(prompts, completions, answers, **kwargs) -> list[float]`,
one float per completion (a completion is a str, or a conversation: a list of
{"role", "content"} messages). `load_reward(spec)` returns a `UserReward`, a callable of the
same shape that runs the function in a worker process (`jetrl/data/reward_worker.py`), so that
a reward that hangs can be stopped. The reward file is code the user chose to run; completions
reach it as data, and only JSON comes back (parsed with `json.loads`).

What each failure gets (every message names the function, "reward 'file.py:fn'"):

| failure | result |
|---|---|
| no such file or module, an import that raises, no such function, not callable | ValueError when loaded, before anything runs |
| a result that is not a list (a dict, a str, a generator; a tuple or a numpy vector is taken), has the wrong length, or holds a non-number | RewardError (the function's bug would recur every batch) |
| an exception inside the function | the batch scores 0, with a warning holding the exception |
| None, NaN or Inf values, or values beyond float32's range (1e300: Inf once cast) | those completions score 0, with a warning and a count |
| no reply within `timeout` seconds (a hang) | the worker is killed with its process group (what it started too), the batch scores 0, with a warning; the next batch starts a new worker |
| the worker process dies | the batch scores 0, with a warning; a new worker is started |
| `max_failures` failing batches in a row (exceptions, hangs, deaths) | RewardError: a run does not go on with a reward that always fails |

Counts are in `UserReward.stats`. See docs/tasks.md ("Your own reward").
"""

from __future__ import annotations

import atexit
import json
import math
import os
import subprocess
import sys
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

from jetrl.data.pipes import kill_worker, read_line
from jetrl.data.task import check_reward_args

WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
DEFAULT_TIMEOUT = 60.0  # seconds per batch
DEFAULT_START_TIMEOUT = 120.0  # seconds to import the user's module
DEFAULT_MAX_FAILURES = 3
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


class RewardError(RuntimeError):
  """A user reward function that cannot be used: a wrong result, or failing batch after batch."""


def check_spec_form(spec: Any) -> str:
  """`spec` if it has the form 'path/to/file.py:fn' or 'module:fn' (nothing is looked up);
  ValueError otherwise."""
  if not isinstance(spec, str):
    raise ValueError(
      f"a reward is named 'path/to/file.py:function' or 'module:function', got "
      f"{type(spec).__name__}"
    )
  target, sep, name = spec.rpartition(":")
  if not sep or not target.strip() or not name.isidentifier():
    raise ValueError(
      f"reward {spec!r}: expected 'path/to/file.py:function' or "
      "'module:function' (a Python identifier after the last ':')"
    )
  return spec


def check_spec(spec: Any) -> str:
  """`spec` if it has the form 'path/to/file.py:fn' or 'module:fn' and a file it names
  exists; ValueError otherwise."""
  target = check_spec_form(spec).rpartition(":")[0]
  if (target.endswith(".py") or os.sep in target) and not os.path.isfile(target):
    raise ValueError(f"reward {spec!r}: file {target!r} does not exist")
  return spec


def _check_positive(name: str, value: Any) -> float:
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not (math.isfinite(value) and value > 0)
  ):
    raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
  return float(value)


class UserReward:
  """`fn(prompts, completions, answers, **kwargs) -> list[float]` run in a worker process.

  spec: 'path/to/file.py:fn' (relative to the working directory) or 'module:fn' (imported with
    the working directory first on the path).
  timeout: seconds one batch may take; past it the batch scores 0 (see the module docstring).
  max_failures: failing batches in a row after which a call raises RewardError.
  start_timeout: seconds the worker may take to import the function.
  log: where warnings go besides `warnings.warn` (e.g. the run's log).
  """

  def __init__(
    self,
    spec: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_failures: int = DEFAULT_MAX_FAILURES,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    log: Optional[Callable[[str], None]] = None,
  ):
    self.spec = check_spec(spec)
    self.name = f"reward {spec!r}"
    self.timeout = _check_positive("timeout", timeout)
    self.start_timeout = _check_positive("start_timeout", start_timeout)
    if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
      raise ValueError(f"max_failures must be a positive int, got {max_failures!r}")
    self.max_failures = max_failures
    self.log = log
    self.proc = None
    self.owner = None
    self.buffer = b""
    self.eof = False
    self.next_id = 0
    self.failures_in_a_row = 0
    self.stats = {"calls": 0, "errors": 0, "timeouts": 0, "deaths": 0, "non_finite": 0, "starts": 0}
    self._start()  # load errors surface here, before a run starts
    _LIVE.add(self)

  # ---- the worker ------------------------------------------------------------------------

  def _start(self) -> None:
    env = dict(os.environ, JETRL_REWARD_SYS_PATH=json.dumps([p for p in sys.path if p]))
    self.proc = subprocess.Popen(
      [sys.executable, "-B", WORKER_PATH, self.spec],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=None,
      bufsize=0,
      close_fds=True,
      env=env,
      start_new_session=True,  # its own process group: what it starts is killed with it
    )
    self.owner = os.getpid()
    self.buffer = b""
    self.eof = False
    self.stats["starts"] += 1
    line = self._read_line(self.start_timeout)
    try:
      ready = json.loads(line) if line is not None else {}
    except ValueError:
      ready = {}
    if ready.get("ready") is not True:
      self._kill()
      if line is None:
        raise ValueError(
          f"{self.name}: the function was not loaded within {self.start_timeout:g}"
          " s (does importing the file hang?)"
        )
      raise ValueError(f"{self.name}: {ready.get('error', 'the worker did not start')}")

  def _kill(self) -> None:
    proc, self.proc = self.proc, None
    if proc is not None and self.owner == os.getpid():
      kill_worker(proc, group=True)  # a function that forked leaves no process behind

  def _read_line(self, timeout: float) -> Optional[bytes]:
    line, self.buffer, closed = read_line(self.proc.stdout.fileno(), self.buffer, timeout)
    self.eof = self.eof or closed
    return line

  def close(self) -> None:
    self._kill()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self._kill()
    except Exception:  # pylint: disable=broad-except
      pass

  # ---- scoring ---------------------------------------------------------------------------

  def _warn(self, message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    if self.log is not None:
      self.log(f"warning: {message}")

  def _failed(self, n: int, why: str) -> list:
    self.failures_in_a_row += 1
    if self.failures_in_a_row >= self.max_failures:
      raise RewardError(
        f"{self.name} failed on {self.failures_in_a_row} batches in a row; the last: {why}"
      )
    self._warn(f"{self.name}: {why}; the batch of {n} scores 0")
    return [0.0] * n

  def __call__(
    self,
    prompts: Optional[Sequence[Any]],
    completions: Sequence[Any],
    answers: Sequence[Any],
    **kwargs,
  ) -> list[float]:
    check_reward_args(prompts, completions, answers)
    n = len(completions)
    rid = self.next_id + 1
    try:
      request = json.dumps(
        {
          "id": rid,
          "prompts": None if prompts is None else list(prompts),
          "completions": list(completions),
          "answers": list(answers),
          "kwargs": kwargs,
        },
        allow_nan=False,
      )
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"{self.name}: the batch cannot be sent to the reward process (only JSON values can): {e}"
      ) from None
    self.next_id = rid
    self.stats["calls"] += 1
    if self.proc is not None and (self.owner != os.getpid() or self.proc.poll() is not None):
      self._kill()
    if self.proc is None:
      self._start()
    try:
      self.proc.stdin.write(request.encode() + b"\n")
    except (BrokenPipeError, OSError):
      pass  # the worker is gone: noticed below as a missing reply
    line = self._read_line(self.timeout)
    if line is None:
      code = None
      if self.eof:
        try:
          code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
          pass
      self._kill()
      if self.eof:
        self.stats["deaths"] += 1
        return self._failed(n, f"its process exited (code {code})")
      self.stats["timeouts"] += 1
      return self._failed(n, f"no result within {self.timeout:g} s (the process was stopped)")
    try:
      reply = json.loads(line)
    except ValueError:
      reply = None
    if not isinstance(reply, dict) or reply.get("id") != rid:
      self._kill()
      self.stats["deaths"] += 1
      return self._failed(n, "its process answered out of turn")
    if "error" in reply:
      self.stats["errors"] += 1
      frames = [
        ln.strip()
        for ln in str(reply.get("traceback", "")).splitlines()
        if ln.startswith("  File ")
      ]
      where = f" ({frames[-1]})" if frames else ""
      return self._failed(n, f"raised {reply['error']}{where}")
    if "bad" in reply:
      raise RewardError(f"{self.name} {reply['bad']}; it must return one float per completion")
    rewards = reply.get("rewards")
    if not isinstance(rewards, list) or len(rewards) != n:
      got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
      raise RewardError(
        f"{self.name} returned {got} values for {n} completions; it must return "
        "one float per completion"
      )
    out, bad = [], 0
    for v in rewards:
      x = _as_float(v)
      if not finite_in_float32(x):
        bad += 1
        x = 0.0
      out.append(x)
    self.failures_in_a_row = 0
    if bad:
      self.stats["non_finite"] += bad
      self._warn(
        f"{self.name} returned {bad} values of {n} that are None, NaN or Inf (in float32: "
        "1e300 is Inf there); they score 0"
      )
    return out


def finite_in_float32(x: float) -> bool:
  """Whether x stays finite as the float32 the trainer holds it in (1e300 does not)."""
  return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _as_float(v: Any) -> float:
  """A reply's value as a float: numbers as they are; None, and the worker's "nan" / "inf"
  spellings, as NaN / Inf; anything else NaN."""
  if isinstance(v, bool) or not isinstance(v, (int, float, str)):
    return math.nan
  try:
    return float(v)
  except ValueError:
    return math.nan


_LIVE: "weakref.WeakSet[UserReward]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
  for reward in list(_LIVE):
    reward.close()


def load_reward(spec: str, **kwargs) -> UserReward:
  """The user reward named by `spec` ('path/to/file.py:fn' or 'module:fn'), loaded and ready
  (a ValueError names what is wrong with it); keyword arguments go to `UserReward`."""
  return UserReward(spec, **kwargs)
