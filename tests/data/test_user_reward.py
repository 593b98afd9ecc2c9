"""A user's reward function loaded by path or module name, and every way it can fail: each is
a clear error naming the function, or a bounded, counted zero reward; never a stuck run."""

from __future__ import annotations

import textwrap
import time
import warnings

import pytest

from jetrl.data import RewardError, WithReward, get_task, load_reward

REWARDS = """
import math
from helper import SCALE  # a neighbour of the reward file

def contains(prompts, completions, answers, **kwargs):
  print("the reward may print")  # goes to stderr, not into the protocol
  return [SCALE * float(a in c) for c, a in zip(completions, answers)]

def with_kwargs(prompts, completions, answers, bonus=0.0, **kwargs):
  return [bonus + len(p) for p in prompts]

def short(prompts, completions, answers, **kwargs):
  return [1.0]

def not_a_list(prompts, completions, answers, **kwargs):
  return 1.0

def words(prompts, completions, answers, **kwargs):
  return ["high"] * len(completions)

def raises(prompts, completions, answers, **kwargs):
  return {}["missing"]

def non_finite(prompts, completions, answers, **kwargs):
  return [math.nan, None, math.inf, 0.5]

def hangs(prompts, completions, answers, **kwargs):
  while True:
    pass

def dies(prompts, completions, answers, **kwargs):
  import os
  os._exit(7)

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
  d = tmp_path_factory.mktemp("rewards")
  (d / "helper.py").write_text("SCALE = 2.0\n")
  (d / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
  return d / "my_rewards.py"


def test_reward_file_by_path(reward_file):
  with load_reward(f"{reward_file}:contains") as r:
    assert r(["p1", "p2"], ["it is 4", [{"role": "assistant", "content": "5"}]], ["4", "6"]) == [
      2.0,
      0.0,
    ]
    assert r(None, ["x"], ["x"]) == [2.0]
    assert r.stats["calls"] == 2 and r.stats["starts"] == 1


def test_reward_by_module_name_with_keyword_arguments(reward_file, monkeypatch):
  monkeypatch.chdir(reward_file.parent)  # 'module:fn' resolves from the working directory
  with load_reward("my_rewards:with_kwargs") as r:
    assert r(["ab", "abcd"], ["", ""], ["", ""], bonus=0.5) == [2.5, 4.5]
  # as the reward of a task: the task's problems, the user's scores
  task = WithReward(get_task("addition", seed=0), load_reward("my_rewards:with_kwargs"))
  assert task.reward(["abc"], ["x"], ["1"]) == [3.0]


@pytest.mark.parametrize(
  "spec, match",
  [
    ("{f}:missing", "has no function 'missing'; it defines .*'contains'"),
    ("{f}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
    ("{d}/nowhere.py:fn", "file '.*nowhere.py' does not exist"),
    ("no_such_module_here:fn", "module 'no_such_module_here' could not be imported"),
    ("{f}", "expected 'path/to/file.py:function' or 'module:function'"),
    ("{f}:2fast", "a Python identifier after the last ':'"),
  ],
)
def test_load_errors_name_the_function(reward_file, spec, match):
  spec = spec.format(f=reward_file, d=reward_file.parent)
  with pytest.raises(ValueError, match=f"reward '.*': .*{match}" if ":" in spec else match):
    load_reward(spec)


def test_a_file_that_raises_on_import(tmp_path):
  bad = tmp_path / "broken.py"
  bad.write_text("import nonexistent_package_xyz\n")
  with pytest.raises(ValueError, match="broken.py.* raised ModuleNotFoundError while loading"):
    load_reward(f"{bad}:fn")


@pytest.mark.parametrize(
  "fn, match",
  [
    ("short", "returned 1 values for 2 completions"),
    ("not_a_list", "returned a float, not a list of floats"),
    ("words", "returned a non-number at position 0: str 'high'"),
  ],
)
def test_wrong_results_are_errors(reward_file, fn, match):
  with load_reward(f"{reward_file}:{fn}") as r:
    with pytest.raises(RewardError, match=f"reward '.*:{fn}' {match}"):
      r(None, ["a", "b"], ["a", "b"])


def test_an_exception_scores_the_batch_zero(reward_file):
  with load_reward(f"{reward_file}:raises", max_failures=2) as r:
    with pytest.warns(
      RuntimeWarning,
      match="raises': raised KeyError: 'missing' \\(File "
      ".*my_rewards.py.*in raises\\); the batch of 2 scores 0",
    ):
      assert r(None, ["a", "b"], ["a", "b"]) == [0.0, 0.0]
    with pytest.raises(
      RewardError, match="failed on 2 batches in a row; the last: raised KeyError"
    ):
      r(None, ["a"], ["a"])
    assert r.stats["errors"] == 2


def test_non_finite_values_score_zero(reward_file):
  logged = []
  with load_reward(f"{reward_file}:non_finite", log=logged.append) as r:
    with pytest.warns(RuntimeWarning, match="returned 3 values of 4 that are None, NaN or Inf"):
      assert r(None, list("abcd"), list("abcd")) == [0.0, 0.0, 0.0, 0.5]
    assert r.stats["non_finite"] == 3 and "None, NaN or Inf" in logged[0]


def test_a_hang_is_stopped(reward_file):
  with load_reward(f"{reward_file}:hangs", timeout=0.5, max_failures=2) as r:
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="no result within 0.5 s"):
      assert r(None, ["a"], ["a"]) == [0.0]
    with pytest.raises(RewardError, match="failed on 2 batches in a row"):
      r(None, ["a"], ["a"])
    assert time.monotonic() - start < 30  # bounded (generous: two starts and two timeouts)
    assert r.stats["timeouts"] == 2 and r.stats["starts"] == 2


def test_a_dying_worker_is_replaced(reward_file, tmp_path):
  with load_reward(f"{reward_file}:dies") as r:
    with pytest.warns(RuntimeWarning, match="its process exited \\(code 7\\)"):
      assert r(None, ["a"], ["a"]) == [0.0]
  ok = tmp_path / "ok.py"
  ok.write_text("def one(p, c, a):\n  return [1] * len(c)\n")
  with load_reward(f"{ok}:one") as r:
    assert r(None, ["a"], ["a"]) == [1.0]
    r.proc.kill()  # gone between batches: a new worker, no failure
    r.proc.wait()
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert r(None, ["a", "b"], ["a", "b"]) == [1.0, 1.0]
    assert r.stats["starts"] == 2


def test_only_json_reaches_the_worker(reward_file):
  with load_reward(f"{reward_file}:contains") as r:
    with pytest.raises(ValueError, match="only JSON values can"):
      r(None, [object()], ["a"])
    with pytest.raises(ValueError, match="same length"):
      r(None, ["a", "b"], ["a"])


@pytest.mark.parametrize(
  "kw, match",
  [
    ({"timeout": 0}, "timeout must be a positive"),
    ({"timeout": float("nan")}, "timeout must be"),
    ({"max_failures": 0}, "max_failures must be"),
  ],
)
def test_bad_options(reward_file, kw, match):
  with pytest.raises(ValueError, match=match):
    load_reward(f"{reward_file}:contains", **kw)


def test_the_documented_example_reward_loads_and_scores(root, monkeypatch):
  """experiments/my_rewards.py:score, as experiments/train.py's doc passes it with
  --task.reward, loads from the repository root and scores hand-made completions."""
  from jetrl.train.validation import check_reward

  spec = "experiments/my_rewards.py:score"
  assert f"--task.reward={spec}" in (root / "experiments" / "train.py").read_text()
  monkeypatch.chdir(root)
  check_reward(spec)
  completions = [
    "3 boxes of 360 make 1,080",  # the last number is the answer
    "1080 is wrong, it is 7",  # the answer, but not last
    "no idea",
    "x" * 401 + " 1080.0",  # right, but rambling
    [{"role": "assistant", "content": "it is 1080"}],  # chat messages
  ]
  with load_reward(spec) as r:
    got = r(None, completions, ["1080"] * 5)
  assert got == pytest.approx([1.0, 0.2, 0.0, 0.9, 1.0])
