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
  5. otherwise sympy decides (numeric or symbolic equivalence) in a worker process
     (`jetrl.data.sympy_client`), with a time limit per comparison that the worker keeps
     itself (no restart); a worker that overruns it is replaced by a spare started
     beforehand. A comparison that runs out of time, fails to parse, or errs counts as not
     equal.

The worker parses answers with a grammar that builds sympy values from tokens (model output
never reaches anything that evaluates or re-parses a string), and it runs with resource limits
and without root (`jetrl/data/sympy_worker.py`, docs/reliability.md).

`math_equal` never raises and never waits longer than about `timeout` seconds per sympy
comparison (plus the worker's start-up, once per process), and not past `deadline` (a
`time.monotonic()` value) when one is given: `math_reward` uses it to bound the sympy time of
each completion and of a whole batch.
"""

from __future__ import annotations

import re
from fractions import Fraction

from jetrl.data.math_normalize import MAX_ANSWER_CHARS, normalize_latex, split_name
from jetrl.data.sympy_client import (  # noqa: F401  (re-exported: the worker's public names)
  _CACHE,
  _WORKER,
  count_over_budget,
  deadline_left,
  shutdown_worker,
  start_worker,
  symbolic_equal,
  worker_stats,
)

DEFAULT_TIMEOUT = 1.0  # seconds per completion's sympy comparisons, a worker restart included
MAX_ITEMS = 32

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
