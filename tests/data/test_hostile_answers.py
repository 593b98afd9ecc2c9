"""Model output is data, never code: hostile answers run nothing (a marker file never appears),
stay bounded in time, and the sympy worker runs confined (limits, not root).

Every payload tries to create a marker file. The integer-encoded one is checked to be live: fed
to sympy's own string parsing in a separate process, it does create its marker."""

import os
import pickle
import subprocess
import sys
import time

import pytest

from jetrl.data import get_task, math_equal, math_reward
from jetrl.data import latex_grammar, sympy_worker
from jetrl.data.math_equivalence import _CACHE, _WORKER, worker_stats


@pytest.fixture()
def marker(tmp_path):
  """A marker path in a directory anyone may write to (so the unprivileged worker could)."""
  d = tmp_path / "open"
  d.mkdir()
  os.chmod(d, 0o777)
  return d / "pwned"


def shell_code(path) -> str:
  return f"__import__('os').system('touch {path}')"


def encoded_int(path) -> tuple[int, int]:
  """The shell code as (an integer, its length in bytes): no quote or dunder in sight."""
  data = shell_code(path).encode()
  return int.from_bytes(data, "big"), len(data)


def encoded_int_payload(path) -> str:
  """The reported exploit: sympy's sin() re-parses a string built from an integer."""
  n, length = encoded_int(path)
  return f"sin(({n}).p.to_bytes({length}).decode())"


class _Evil:
  def __reduce__(self):
    return (os.system, ("touch MARKER",))


def payloads(path) -> list:
  code = shell_code(path)
  encoded = encoded_int_payload(path)
  pickled = pickle.dumps(_Evil(), protocol=0).decode("latin-1").replace("MARKER", str(path))
  return [
    encoded,
    "\\sin{" + encoded + "}",
    "\\frac{" + encoded + "}{2}",
    "S(({}).p.to_bytes({}).decode())".format(*encoded_int(path)),
    "Symbol(1).__class__.__mro__[-1].__subclasses__()",
    f"x.__class__.__init__.__globals__['os'].system('touch {path}')",
    "getattr(getattr(x, '__class__'), '__init__')",
    f"(lambda: {code})()",
    f"lambda: {code}",
    f'f"{{{code}}}"',
    "'{0.__class__.__init__.__globals__}'.format(x)",
    f"'%s' % ({code})",
    "().__class__.__base__.__subclasses__()[0]",
    f"pickle.loads({pickled!r})",
    f"__builtins__['eval']({code!r})",
    f"ｅｘｅｃ({code!r})",  # fullwidth letters: NFKC makes them `exec`
    f"eval(chr(95)+chr(95)+{code!r})",
    f"\\input{{{path}}}",
    f"\\immediate\\write18{{touch {path}}}",
    "\\def\\x{" + code + "}\\x",
    f"\\text{{{code}}}",
    f"1; {code}",
    "{" * 3000 + "5" + "}" * 3000,
    "(" * 300 + "5" + ")" * 300,
    "\\sqrt{" * 200 + "5" + "}" * 200,
    "10^{10^{10}}",
    "9^{9^{9^{9}}}",
    "(10^{10})!",
    "2^{2^{2^{2^{2^{2}}}}}",
    "\\binom{10^{10}}{10^{9}}",
    "1e400",
    "10^{-10^{10}}",
  ]


def test_the_encoded_payload_is_live(marker):
  """Sanity check of the test itself: sympy's own string parsing does run it."""
  n, length = encoded_int(marker)
  code = (
    "import sympy\n"
    "try:\n"
    f"  sympy.sin(sympy.Integer({n}).p.to_bytes({length}).decode())\n"
    "except Exception:\n"
    "  pass\n"
  )
  subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
  assert marker.exists()


def test_hostile_answers_run_nothing_in_the_grammar_itself(marker):
  """The grammar and the comparison, in this process, with no sandbox around them."""
  for p in payloads(marker):
    assert not sympy_worker.equivalent(p, "5", latex_grammar.parse_latex)
    assert not sympy_worker.equivalent(p, p + "+1", latex_grammar.parse_latex)
  assert not marker.exists()


def test_hostile_answers_score_zero_through_every_entry_point(marker):
  hostile = payloads(marker)
  start = time.monotonic()
  boxed = [f"The answer is \\boxed{{{p}}}." for p in hostile]
  assert math_reward(None, boxed, ["5"] * len(boxed), timeout=1.0) == [0.0] * len(boxed)
  task = get_task("math500", timeout=1.0)
  assert task.reward(None, boxed, ["5"] * len(boxed)) == [0.0] * len(boxed)
  for p in hostile[:6]:
    assert not math_equal(p, "x", timeout=1.0)
  assert time.monotonic() - start < 60
  assert not marker.exists()


def test_a_hostile_batch_is_bounded_in_time():
  # Each is seconds of sympy simplification; 16 of them once cost 16 x the time limit.
  slow = [f"\\boxed{{(x+{k})^{{2^{{12}}}}}}" for k in range(1, 17)]
  good = ["\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{\\sqrt{2}}{2}}"]
  answers = ["x^{4096}+1"] * 16 + ["0.5", "\\frac{1}{\\sqrt{2}}"]
  before = worker_stats()
  start = time.monotonic()
  scores = math_reward(None, slow + good, answers, timeout=1.0, batch_timeout=2.0)
  elapsed = time.monotonic() - start
  assert scores[:16] == [0.0] * 16
  assert scores[16] == 1.0  # decided exactly, before any sympy time is spent
  assert scores[17] == 1.0  # sympy's: its share of the budget is its own, wherever it stands
  after = worker_stats()
  assert after["timeouts"] - before["timeouts"] <= 16  # each hostile one stops at its share
  assert elapsed < 2.0 + 15, elapsed  # the budget, plus one worker start


def test_worker_runs_confined():
  _CACHE.clear()  # a verdict cached by an earlier test would not start the worker
  assert math_equal("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
  pid = _WORKER.proc.pid
  with open(f"/proc/{pid}/status") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
  uids = [int(u) for u in status["Uid"].split()]
  assert 0 not in uids and (os.geteuid() != 0 or uids[0] == 65534), uids
  with open(f"/proc/{pid}/limits") as f:
    limits = {line[:26].strip(): line[26:].split() for line in f}
  assert limits["Max address space"][0] == str(sympy_worker.MEMORY_LIMIT)
  assert limits["Max core file size"][:2] == ["0", "0"]
  assert limits["Max file size"][:2] == ["0", "0"]
  assert limits["Max open files"][0] == str(sympy_worker.MAX_OPEN_FILES)
  assert int(limits["Max cpu time"][1]) <= sympy_worker.WORKER_CPU_SECONDS
  assert limits["Max processes"][0] == "0"


def test_timeouts_are_validated():
  for bad in (0, -1.0, float("nan"), float("inf"), "2", True):
    with pytest.raises(ValueError, match="timeout"):
      math_reward(None, ["\\boxed{1}"], ["1"], timeout=bad)
    with pytest.raises(ValueError, match="batch_timeout"):
      math_reward(None, ["\\boxed{1}"], ["1"], batch_timeout=bad)


def test_a_worker_that_cannot_leave_root_turns_sympy_off_with_a_warning(tmp_path, monkeypatch):
  """What the parent does when the worker refuses to run (it answers ready: false)."""
  from jetrl.data import sympy_client

  fake = tmp_path / "worker.py"
  fake.write_text(
    'import json\nprint(json.dumps({"ready": False, "error": "PermissionError: '
    'cannot leave root"}), flush=True)\n'
  )
  monkeypatch.setattr(sympy_client, "WORKER_PATH", str(fake))
  worker = sympy_client._Worker()
  with pytest.warns(
    RuntimeWarning, match="could not start .*cannot leave root.*symbolic answer comparison is off"
  ):
    assert worker.ask("x", "x+0", 1.0, None) is None
  assert worker.ask("x", "x+0", 1.0, None) is None  # no further attempts, no further warnings
  assert worker.stats["restarts"] == 0 and worker.proc is None
