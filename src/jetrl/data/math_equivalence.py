"""Whether two MATH-style final answers are equal.

`math_equal(pred, gold)` decides in this order, stopping at the first that applies:
  1. the normalised strings (`normalize_latex`, then a leading `x=` dropped from both when
     both name the same variable or one is a bare value: `same_names`) are identical -> equal;
  2. both are plain numbers, fractions (`\\frac{a}{b}`, `a/b`) or mixed numbers
     (`2\\frac{1}{2}`) -> compared exactly as rationals;
  3. both are bracketed tuples / intervals / sets / matrices with the same brackets -> equal
     when they have the same number of items and the items are equal in order; both are
     unbracketed comma lists (`-2,1`) and sets -> equal when the items match in some order
     (`a \\pm b` counts as the list `a+b, a-b`);
  4. either holds words (`\\text{east}` after normalising) -> equal when the texts are;
  5. otherwise sympy decides (numeric or symbolic equivalence) in a worker process, with a
     time limit per comparison. A comparison that times out, fails to parse, or errs counts as
     not equal. The worker is restarted after a timeout.

The worker parses answers with a grammar that builds sympy values from tokens (model output
never reaches anything that evaluates or re-parses a string), and it runs with resource limits
and without root (`jetrl/data/sympy_worker.py`, docs/reliability.md).

`math_equal` never raises and never waits longer than about `timeout` seconds per sympy
comparison (plus the worker's start-up, once per process and after each timeout), and not past
`deadline` (a `time.monotonic()` value) when one is given: `math_reward` uses it to bound the
sympy time of a whole batch.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import threading
import time
import warnings
from fractions import Fraction

from jetrl.data.math_normalize import MAX_ANSWER_CHARS, normalize_latex, split_name
from jetrl.data.pipes import kill_worker, read_line, spawn_confined

DEFAULT_TIMEOUT = 2.0  # seconds per sympy comparison
STARTUP_TIMEOUT = 60.0
CACHE_SIZE = 65536
MAX_ITEMS = 32
WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sympy_worker.py")

_INT = r"-?[0-9]{1,60}"
_DECIMAL = re.compile(r"-?(?:[0-9]{1,60}(?:\.[0-9]{1,60})?|\.[0-9]{1,60})")
_FRAC = re.compile(r"(-?)\\frac\{(%s)\}\{(%s)\}" % (_INT, _INT))
_SLASH = re.compile(r"(%s)/(%s)" % (_INT, _INT))
_MIXED = re.compile(r"(-?)([0-9]{1,60})\\frac\{([0-9]{1,60})\}\{([0-9]{1,60})\}")
_TEXT_WORDS = re.compile(r"\\text\{([^{}]*)\}")
_PM = re.compile(r"\\pm(?![A-Za-z])")
_OPENERS = ("(", "[", "\\{")
_CLOSERS = (")", "]", "\\}")
_MATRIX = re.compile(r"\\begin\{([pbvBV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}")


def as_fraction(s: str) -> Fraction | None:
  """The exact value of a plain number, fraction or mixed number, else None."""
  try:
    if _DECIMAL.fullmatch(s):
      return Fraction(s)
    m = _FRAC.fullmatch(s)
    if m:
      value = Fraction(int(m.group(2)), int(m.group(3)))
      return -value if m.group(1) else value
    m = _SLASH.fullmatch(s)
    if m:
      return Fraction(int(m.group(1)), int(m.group(2)))
    m = _MIXED.fullmatch(s)
    if m:
      value = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
      return -value if m.group(1) else value
  except (ValueError, ZeroDivisionError):
    return None
  return None


def _split_top(s: str, sep: str = ",") -> list[str]:
  """Splits at `sep` outside any (), [], {} nesting."""
  items, depth, start, i = [], 0, 0, 0
  while i < len(s):
    c = s[i]
    if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
      depth += 1 if s[i + 1] == "{" else -1
      i += 2
      continue
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif depth == 0 and s.startswith(sep, i):
      items.append(s[start:i])
      start = i + len(sep)
      i = start
      continue
    i += 1
  items.append(s[start:])
  return items


def _structure(s: str):
  """(kind, items) for a bracketed or comma-separated answer, else None.

  kind is the bracket pair (e.g. "[)"), "matrix", or "list" (unbracketed, order-free).
  """
  m = _MATRIX.fullmatch(s)
  if m:
    rows = [r for r in m.group(2).split("\\\\") if r != ""]
    return "matrix", [tuple(r.split("&")) for r in rows]
  opener = next((o for o in _OPENERS if s.startswith(o)), None)
  closer = next((c for c in _CLOSERS if s.endswith(c)), None)
  if opener and closer and len(s) >= len(opener) + len(closer) and _wrapped(s):
    items = _split_top(s[len(opener) : -len(closer)])
    if len(items) > 1 or opener != "(":
      return opener + closer, items
  items = _split_top(s)
  if len(items) > 1:
    return "list", items
  if len(_PM.findall(s)) == 1:  # a \pm b: the two values a + b and a - b
    return "list", [_PM.sub("+", s), _PM.sub("-", s)]
  return None


def _wrapped(s: str) -> bool:
  """Whether the bracket opening s closes exactly at its end (brackets of any kind)."""
  depth = 0
  i = 0
  n = len(s)
  while i < n:
    if s[i] == "\\" and i + 1 < n and s[i + 1] in "{}":
      depth += 1 if s[i + 1] == "{" else -1
      i += 2
    else:
      if s[i] in "([{":
        depth += 1
      elif s[i] in ")]}":
        depth -= 1
      i += 1
    if depth == 0:
      return i == n
  return False


def math_equal(
  pred: str,
  gold: str,
  *,
  timeout: float = DEFAULT_TIMEOUT,
  symbolic: bool = True,
  deadline: float | None = None,
) -> bool:
  """Whether answer `pred` equals answer `gold` (see the module docstring). Never raises."""
  try:
    p, g = same_names(normalize_latex(pred), normalize_latex(gold))
    return _normalized_equal(p, g, timeout, symbolic, 0, deadline)
  except Exception:  # a reward must never raise on a malformed completion
    return False


def same_names(p: str, g: str) -> tuple[str, str]:
  """The normalised answers without their `x=` prefixes where that keeps their meaning: both
  name the same variable, or one of them is a bare value. Different names stay (`y=5` is an
  equation for y, not the value of x)."""
  (np, rp), (ng, rg) = split_name(p), split_name(g)
  if np and ng and np != ng:
    return p, g
  return rp, rg


def deadline_left(deadline: float | None) -> float:
  """Seconds until `deadline` (a time.monotonic() value; None: no deadline)."""
  return float("inf") if deadline is None else deadline - time.monotonic()


def _normalized_equal(
  p: str, g: str, timeout: float, symbolic: bool, depth: int, deadline: float | None = None
) -> bool:
  if p == g:
    return True
  if not p or not g or depth > 3 or len(p) > MAX_ANSWER_CHARS or len(g) > MAX_ANSWER_CHARS:
    return False
  fp, fg = as_fraction(p), as_fraction(g)
  if fp is not None and fg is not None:
    return fp == fg
  sp, sg = _structure(p), _structure(g)
  if sp is not None or sg is not None:
    if sp is None or sg is None or sp[0] != sg[0] or len(sp[1]) != len(sg[1]):
      return False
    if len(sp[1]) > MAX_ITEMS:
      return False
    same = lambda a, b: _normalized_equal(a, b, timeout, symbolic, depth + 1, deadline)
    if sp[0] == "matrix":
      return all(
        len(rp) == len(rg) and all(same(a.strip(), b.strip()) for a, b in zip(rp, rg))
        for rp, rg in zip(sp[1], sg[1])
      )
    if sp[0] in ("list", "\\{\\}"):  # unbracketed lists and sets: any order
      return _match_unordered(sp[1], sg[1], same)
    return all(same(a, b) for a, b in zip(sp[1], sg[1]))
  if "\\text{" in p or "\\text{" in g:  # words are compared as text, never as products
    return _TEXT_WORDS.sub(r"\1", p) == _TEXT_WORDS.sub(r"\1", g)
  if not symbolic:
    return False
  return symbolic_equal(p, g, timeout, deadline=deadline)


def _match_unordered(pred_items, gold_items, same) -> bool:
  left = list(gold_items)
  for item in pred_items:
    for k, other in enumerate(left):
      if same(item, other):
        del left[k]
        break
    else:
      return False
  return True


# ---- the sympy worker -------------------------------------------------------------------


class _Worker:
  """A long-lived, confined `python sympy_worker.py` child process, restarted after a timeout."""

  def __init__(self):
    self.proc = None
    self.owner = None
    self.buffer = b""
    self.next_id = 0
    self.failed_starts = 0
    self.lock = threading.Lock()
    self.stats = {"requests": 0, "timeouts": 0, "restarts": 0, "over_budget": 0}

  def _start(self) -> bool:
    if self.failed_starts >= 2:
      return False
    try:
      self.proc = spawn_confined(WORKER_PATH)
      self.owner = os.getpid()
      self.buffer = b""
      line = self._read_line(STARTUP_TIMEOUT)
      ready = json.loads(line) if line is not None else {}
      if ready.get("ready") is not True:
        if "error" in ready:  # the worker refused to run (e.g. it could not leave root)
          self.failed_starts = 1
        raise RuntimeError(ready.get("error", "no ready line"))
      self.stats["restarts"] += 1
      return True
    except Exception as e:  # no worker: symbolic comparison is off in this process
      self._kill()
      self.failed_starts += 1
      if self.failed_starts >= 2:
        warnings.warn(
          f"jetrl.data: the sympy worker could not start ({e}); symbolic answer "
          "comparison is off in this process",
          RuntimeWarning,
          stacklevel=3,
        )
      return False

  def _kill(self):
    proc, self.proc = self.proc, None
    if proc is not None and self.owner == os.getpid():
      kill_worker(proc, wait_s=5)

  def _read_line(self, timeout: float) -> bytes | None:
    line, self.buffer, _ = read_line(self.proc.stdout.fileno(), self.buffer, timeout)
    return line

  def ask(self, a: str, b: str, timeout: float, deadline: float | None) -> bool | None:
    """The worker's verdict, or None when there is none (timeout, no worker, no time left)."""
    with self.lock:
      if self.proc is not None and (self.owner != os.getpid() or self.proc.poll() is not None):
        self._kill()  # (only kills a worker this process started)
      if deadline_left(deadline) <= 0:
        self.stats["over_budget"] += 1
        return None
      if self.proc is None and not self._start():
        return None
      limit = min(timeout, deadline_left(deadline))
      if limit <= 0:
        self.stats["over_budget"] += 1
        return None
      self.stats["requests"] += 1
      self.next_id += 1
      rid = self.next_id
      try:
        self.proc.stdin.write((json.dumps({"id": rid, "a": a, "b": b}) + "\n").encode())
        line = self._read_line(limit)
        if line is None:
          self.stats["timeouts"] += 1
          self._kill()
          return None
        reply = json.loads(line)
        if reply.get("id") != rid:
          self._kill()
          return None
        return reply.get("eq") is True
      except Exception:
        self._kill()
        return None

  def close(self):
    with self.lock:
      self._kill()


_WORKER = _Worker()
atexit.register(_WORKER.close)
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def symbolic_equal(
  a: str, b: str, timeout: float = DEFAULT_TIMEOUT, *, deadline: float | None = None
) -> bool:
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


def count_over_budget() -> None:
  """Counts one comparison left out because its batch's time was spent."""
  with _WORKER.lock:
    _WORKER.stats["over_budget"] += 1


def worker_stats() -> dict:
  """Counts of sympy requests, timeouts, (re)starts and comparisons refused for lack of batch
  time (over_budget) in this process."""
  return dict(_WORKER.stats)


def shutdown_worker() -> None:
  """Stops the sympy worker (a later comparison starts a new one)."""
  _WORKER.close()
