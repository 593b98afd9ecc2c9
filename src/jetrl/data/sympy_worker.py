"""Symbolic equivalence of two normalised LaTeX answers, run in a separate, confined process.

`jetrl.data.sympy_client` starts this file as a script (`python -I -B sympy_worker.py`,
working directory `/`) and talks to it over pipes, one JSON object per line:

  ready    {"ready": true}          (or {"ready": false, "error": "..."}, then it exits)
  request  {"id": 7, "a": "\\frac{1}{\\sqrt{2}}", "b": "\\frac{\\sqrt{2}}{2}", "limit": 0.85}
  reply    {"id": 7, "eq": true}   (or {"id": 7, "eq": false, "late": true} past the limit)

A request's `limit` (seconds) is kept by a real-time interval timer whose signal stops the
comparison, so a slow answer costs its limit and no restart; the parent kills the worker only
when even that reply does not come.

The answers are model output, so they are data, never code: `latex_grammar.py` (beside this
file, loaded by path with its tokenizer `latex_tokens.py`) builds sympy values from tokens,
and nothing here passes a string to anything that parses it. As a second line of defence the
process confines itself before it reads the first request:

  - resource limits: address space (MEMORY_LIMIT), CPU time (REQUEST_CPU_SECONDS per request,
    WORKER_CPU_SECONDS over the process's life; past either the kernel ends it), no core
    files, no file writes (RLIMIT_FSIZE 0), at most MAX_OPEN_FILES descriptors, and no new
    processes (RLIMIT_NPROC 0, once unprivileged);
  - privileges: started as root, it switches to the unprivileged user `nobody` (uid/gid 65534
    when that name is missing) with no supplementary groups. When that is impossible (no
    CAP_SETUID in a restricted container, say), it refuses to run: it answers
    {"ready": false, "error": ...} and exits; the parent then turns symbolic comparison off
    for that process with a warning, and answers are compared without sympy (exact strings,
    rationals, tuples).

The parent kills the worker when a reply is late (its per-comparison time limit), and restarts
it; the limits above hold even if the parent is gone. See docs/reliability.md.
"""

import importlib.util
import json
import os
import signal
import sys
import types

MEMORY_LIMIT = 4 << 30  # bytes of address space
REQUEST_CPU_SECONDS = 30  # CPU seconds one request may use (the parent's limit is lower)
WORKER_CPU_SECONDS = 3600  # CPU seconds over the worker's life; the parent restarts it
MAX_OPEN_FILES = 16
UNPRIVILEGED_USER = "nobody"
UNPRIVILEGED_ID = 65534
GRAMMAR_DIR = os.path.dirname(os.path.abspath(__file__))
GRAMMAR_PACKAGE = "jetrl_latex"  # the grammar's package in this process: GRAMMAR_DIR alone
# Comparisons run once before the privileges drop, so that every sympy module they need is
# imported while the files are still readable.
WARM_UP = (
  ("\\frac{1}{2}", "0.5"),
  ("x^2+2x+1", "(x+1)^2"),
  ("\\sin\\frac{\\pi}{6}", "0.5"),
  ("\\binom{5}{2}+3!", "\\sqrt[3]{8}\\cdot 8"),
  ("(1,2)", "(1,2)"),
  ("\\log_2 8+\\tan x", "3+\\frac{\\sin x}{\\cos x}"),
)


def load_grammar():
  """The grammar module, loaded from its file (this process does not import jetrl), with the
  sibling it imports (latex_tokens.py) through a package of their folder that runs no
  `__init__`."""
  package = types.ModuleType(GRAMMAR_PACKAGE)
  package.__path__ = [GRAMMAR_DIR]
  sys.modules[GRAMMAR_PACKAGE] = package
  spec = importlib.util.spec_from_file_location(
    f"{GRAMMAR_PACKAGE}.latex_grammar", os.path.join(GRAMMAR_DIR, "latex_grammar.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _expr_equal(a, b) -> bool:
  """Whether a equals b, exactly: the grammar reads decimals as the rationals they write, so
  every value here is exact, and a difference is zero or it is not (`1000!+1` is not `1000!`;
  `2220+10^{-7}` is not `2220`). A relative tolerance once made both equal."""
  import sympy  # pylint: disable=import-outside-toplevel

  if isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
    return (
      isinstance(a, sympy.Tuple)
      and isinstance(b, sympy.Tuple)
      and len(a) == len(b)
      and all(_expr_equal(x, y) for x, y in zip(a, b))
    )
  if a == b:
    return True
  if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
    return False
  unbounded = (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan)
  if a.has(*unbounded) or b.has(*unbounded):
    return False
  diff = a - b
  if diff.is_Rational:  # exact values: equal only when the difference is exactly 0
    return bool(diff == 0)
  if diff.is_number:  # in sympy Floats (a Python float overflows past 1e308)
    error = sympy.Abs(sympy.N(diff, 60))
    scale = sympy.Max(1, sympy.Abs(sympy.N(b, 60)))
    if error > scale / 10**40:  # certainly different
      return False
  return sympy.simplify(diff) == 0 or (diff.is_number and diff.equals(0) is True)


def equivalent(a: str, b: str, parse) -> bool:
  """Whether normalised LaTeX answers `a` and `b` have the same value (False if unsure).

  `parse` is the grammar's `parse_latex`. One equation on each side compares lhs - rhs up to
  sign; any other relation is not compared.
  """
  try:
    if a.count("=") == 1 and b.count("=") == 1:
      la, ra = (parse(x) for x in a.split("="))
      lb, rb = (parse(x) for x in b.split("="))
      return _expr_equal(la - ra, lb - rb) or _expr_equal(la - ra, rb - lb)
    if any(c in s for c in "=<>" for s in (a, b)):
      return False
    return _expr_equal(parse(a), parse(b))
  except Exception:  # anything unparsable or unsupported is "not shown equal"
    return False


class Late(BaseException):
  """The request's time limit passed (a BaseException, so no `except Exception` in sympy
  swallows it)."""


def _late(signum, frame):
  raise Late()


def answer(req: dict, parse) -> dict:
  """The reply to one request {"id", "a", "b", "limit"}: {"id", "eq"}, with "late": true when
  the comparison was stopped at `limit` seconds (a real-time interval timer)."""
  rid, a, b = req.get("id"), req["a"], req["b"]
  limit = req.get("limit")
  if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < 3600:
    signal.setitimer(signal.ITIMER_REAL, float(limit))
  try:
    eq = isinstance(a, str) and isinstance(b, str) and equivalent(a, b, parse)
    return {"id": rid, "eq": bool(eq)}
  except Late:
    return {"id": rid, "eq": False, "late": True}
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


def _confine_module():
  """jetrl/data/confine.py, loaded from its file beside this one (the limits every confined
  worker sets)."""
  spec = importlib.util.spec_from_file_location(
    "jetrl_confine", os.path.join(GRAMMAR_DIR, "confine.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def limit_resources() -> None:
  """Address space, lifetime CPU time, core files and file writes (before any request)."""
  _confine_module().limit_memory_cpu_files(MEMORY_LIMIT, REQUEST_CPU_SECONDS, WORKER_CPU_SECONDS)


def limit_descriptors_and_processes() -> None:
  """At most MAX_OPEN_FILES descriptors and no child processes (after the privilege drop:
  the kernel does not apply RLIMIT_NPROC to root)."""
  _confine_module().limit_descriptors_and_processes(MAX_OPEN_FILES)


def allow_cpu_for_next_request() -> None:
  """Moves the soft CPU limit to REQUEST_CPU_SECONDS past the CPU time used so far."""
  import resource  # pylint: disable=import-outside-toplevel

  used = resource.getrusage(resource.RUSAGE_SELF)
  spent = int(used.ru_utime + used.ru_stime) + 1
  _, hard = resource.getrlimit(resource.RLIMIT_CPU)
  soft = spent + REQUEST_CPU_SECONDS
  if hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def drop_privileges() -> None:
  """Started as root: become `nobody` (no supplementary groups). Raises if that fails."""
  if os.geteuid() != 0 and os.getuid() != 0:
    return
  try:
    import pwd  # pylint: disable=import-outside-toplevel

    entry = pwd.getpwnam(UNPRIVILEGED_USER)
    uid, gid = entry.pw_uid, entry.pw_gid
  except (ImportError, KeyError):
    uid = gid = UNPRIVILEGED_ID
  os.setgroups([])
  os.setresgid(gid, gid, gid)
  os.setresuid(uid, uid, uid)
  if 0 in os.getresuid() or 0 in os.getresgid() or os.getgroups():
    raise PermissionError("still privileged after the switch")


def confine(grammar) -> None:
  """Everything that must happen before the first request is read."""
  limit_resources()
  for a, b in WARM_UP:
    equivalent(a, b, grammar.parse_latex)
  drop_privileges()
  limit_descriptors_and_processes()


def main():
  out = sys.stdout
  try:
    grammar = load_grammar()
    confine(grammar)
  except Exception as e:  # pylint: disable=broad-except
    out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    out.flush()
    return 1
  sys.setrecursionlimit(10_000)
  out.write('{"ready": true}\n')
  out.flush()
  signal.signal(signal.SIGALRM, _late)
  for line in sys.stdin:
    try:
      allow_cpu_for_next_request()
      reply = answer(json.loads(line), grammar.parse_latex)
    except Late:  # the timer fired between the answer and its reset
      reply = {"id": None, "eq": False, "late": True}
    except Exception:  # pylint: disable=broad-except
      reply = {"id": None, "eq": False}
    out.write(json.dumps(reply) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
