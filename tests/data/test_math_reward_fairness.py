"""One completion's cost never changes another's reward: a hostile MATH answer costs at most
the per-completion limit (1 s by default, a worker restart included), and a right answer that
only sympy can decide scores 1 wherever it stands in a batch of hostile ones, inside the
batch's limit."""

import time

import pytest

from jetrl.data import math_reward
from jetrl.data.math_equivalence import DEFAULT_TIMEOUT, _CACHE, math_equal, worker_stats

SLOW = "\\boxed{{(x+{k})^{{2^{{12}}}}}}"  # seconds of sympy simplification each
SLOW_GOLD = "x^{4096}+1"
# Right answers that only the grammar (sympy) decides: no string or rational rule equates them.
RIGHT = [
  ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
  ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
  ("\\boxed{(x+1)^2}", "x^2+2x+1"),
]


def _warm():
  assert math_equal("\\sqrt{12}", "2\\sqrt{3}")  # the worker started, outside the timing


def test_default_per_completion_limit_is_at_most_one_second():
  assert 0 < DEFAULT_TIMEOUT <= 1.0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_hostile_completion_costs_at_most_the_limit_restart_included(k):
  _warm()
  start = time.monotonic()
  assert math_reward(None, [SLOW.format(k=k)], [SLOW_GOLD]) == [0.0]
  assert time.monotonic() - start < 1.0 + 0.6  # (the slack: a loaded machine's scheduling)
  # The next comparison is not charged for what the hostile one did to the worker.
  _CACHE.clear()
  start = time.monotonic()
  assert math_reward(None, [RIGHT[0][0]], [RIGHT[0][1]]) == [1.0]
  assert time.monotonic() - start < 0.8  # (a restart here: seconds, importing sympy)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_right_answer_scores_one_wherever_it_stands(where):
  _warm()
  hostile = [SLOW.format(k=k) for k in range(1, 9)]
  completions, answers = list(hostile), [SLOW_GOLD] * len(hostile)
  at = {"first": 0, "middle": 4, "last": len(hostile)}[where]
  for offset, (right, gold) in enumerate(RIGHT):
    completions.insert(at + offset, right)
    answers.insert(at + offset, gold)
  _CACHE.clear()
  before = worker_stats()
  start = time.monotonic()
  scores = math_reward(None, completions, answers, batch_timeout=3.0)
  elapsed = time.monotonic() - start
  assert scores[at : at + len(RIGHT)] == [1.0] * len(RIGHT)
  assert scores.count(1.0) == len(RIGHT)
  assert elapsed < 3.0 + 0.8, elapsed  # the batch limit holds
  assert worker_stats()["timeouts"] - before["timeouts"] <= len(hostile)


FAKE_WORKER = """import json, sys, time
time.sleep(0.8)  # a start-up as slow as importing sympy
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["a"] == "hang":  # stuck where no timer reaches it, and no reply
        time.sleep(100)
    print(json.dumps({"id": req["id"], "eq": req["a"] == req["b"]}), flush=True)
"""


def test_a_worker_that_overruns_is_replaced_by_its_spare_at_once(tmp_path, monkeypatch):
  from jetrl.data import sympy_client

  fake = tmp_path / "worker.py"
  fake.write_text(FAKE_WORKER)
  monkeypatch.setattr(sympy_client, "WORKER_PATH", str(fake))
  worker = sympy_client._Worker()
  try:
    assert worker.ask("x", "x", 0.5, None) is True
    first = worker.proc.pid
    time.sleep(1.2)  # the spare has started meanwhile
    start = time.monotonic()
    assert worker.ask("hang", "x", 0.5, None) is None  # killed at its limit
    assert time.monotonic() - start < 0.5 + 0.3
    start = time.monotonic()
    assert worker.ask("y", "y", 0.5, None) is True  # the spare answers, no start-up to wait
    assert time.monotonic() - start < 0.5  # (its start-up would be 0.8 s)
    assert worker.proc.pid != first
    assert worker.stats["timeouts"] == 1 and worker.stats["restarts"] == 2
  finally:
    worker.close()
