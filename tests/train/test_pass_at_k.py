"""pass@k and maj@k (`--eval.k`): the estimators on a hand-made set, the flags' checks, each
task's extracted answer, and experiments/evaluate.py printing pass@1, pass@4 and maj@4 that
agree with its own completions table."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jetrl.config import ConfigError
from jetrl.data import Addition, GSM8K, Math500
from jetrl.data.chat_arithmetic import ChatArithmetic
from jetrl.data.task import Task, WithReward, answer_extractor
from jetrl.train import EvalConfig
from jetrl.train.evaluation import at_k_line
from jetrl.train.pass_at_k import at_k_metrics, maj_at_k, majority, pass_at_k

# 3 problems x 4 samples: the checker's verdicts and the extracted answers.
CORRECT = np.array(
  [
    [True, False, False, False],  # c = 1
    [False, False, False, False],  # c = 0
    [True, True, False, True],  # c = 3
  ]
)
ANSWERS = [
  ["7", "5", "5", None],  # "5" wins 2-1 and is wrong (sample 1)
  [None, None, None, None],  # no vote: a miss
  ["3", "4", "4", "3"],  # 2-2: "3" appeared first, and is right (sample 0)
]


def test_pass_and_maj_at_k_by_hand():
  # pass@1 = mean c/n = (1/4 + 0 + 3/4) / 3 = 1/3
  assert pass_at_k(CORRECT, 1) == pytest.approx(1 / 3)
  # pass@2 = 1 - C(n-c, 2)/C(4, 2): (1 - 3/6) = 1/2, (1 - 6/6) = 0, n - c = 1 < 2: 1 -> 1/2
  assert pass_at_k(CORRECT, 2) == pytest.approx(0.5)
  # pass@4 (k = n): a problem counts when any sample is right: (1 + 0 + 1) / 3
  assert pass_at_k(CORRECT, 4) == pytest.approx(2 / 3)
  # maj@4: miss, miss, hit -> 1/3; maj@1 (the first sample alone): "7" right, none, "3" right
  assert maj_at_k(CORRECT, ANSWERS, 4) == pytest.approx(1 / 3)
  assert maj_at_k(CORRECT, ANSWERS, 1) == pytest.approx(2 / 3)
  assert at_k_metrics(CORRECT, ANSWERS, (1, 4)) == pytest.approx(
    {
      "eval_pass_at_1": 1 / 3,
      "eval_maj_at_1": 2 / 3,
      "eval_pass_at_4": 2 / 3,
      "eval_maj_at_4": 1 / 3,
    }
  )
  assert set(at_k_metrics(CORRECT, None, (4,))) == {"eval_pass_at_4"}  # no answers: no maj
  assert majority([None, "a", "b", "b", "a"]) == 1 and majority([None, None]) is None
  # The console line; a task that extracts no answers says maj@k is unavailable.
  assert at_k_line(at_k_metrics(CORRECT, ANSWERS, (1, 4)), (1, 4)) == (
    "pass@1 0.333 maj@1 0.667 pass@4 0.667 maj@4 0.333"
  )
  assert at_k_line(at_k_metrics(CORRECT, None, (4,)), (4,)) == (
    "pass@4 0.667 (maj@k unavailable: the task gives no extracted answers)"
  )
  with pytest.raises(ValueError, match="1 <= k <= n = 4"):
    pass_at_k(CORRECT, 5)


def test_k_needs_sampling_and_enough_samples():
  assert EvalConfig(temperature=1.0, samples=8, k=(1, 4, 8)).k == (1, 4, 8)
  with pytest.raises(ConfigError, match=r"--eval.k=1,4 needs .* --eval.temperature > 0"):
    EvalConfig(k=(1, 4))
  with pytest.raises(ConfigError, match=r"--eval.k=1,8 needs --eval.samples >= 8 .*samples=4"):
    EvalConfig(temperature=1.0, samples=4, k=(1, 8))


def test_each_task_extracts_its_canonical_answer(tmp_path):
  assert answer_extractor(Addition())("12+3=15\nanswer: 15") == "15"
  assert answer_extractor(ChatArithmetic())("so \\boxed{1,080}") == "1080"
  gsm = GSM8K.__new__(GSM8K)  # its reading alone: no data needed
  gsm.order = ("hash", "boxed", "last")
  assert gsm.extract_answer("it is 3\n#### 1,000.50") == "1000.5"
  assert Math500.extract_answer(None, "so \\boxed{\\dfrac{1}{2}}") == "\\frac{1}{2}"
  assert Math500.extract_answer(None, "no box") is None
  # Another reward trains the policy: the vote is on the checker's answers.
  assert (
    answer_extractor(WithReward(Addition(), lambda p, c, a: [0.0] * len(c)))("answer: 4") == "4"
  )

  class Bare(Addition):
    extract_answer = Task.extract_answer  # the base's: none

  assert answer_extractor(Bare()) is None


class Parity(Addition):
  """1-digit addition whose checker calls an even-length completion right and extracts its
  length mod 3: verdicts and votes that vary on a random tiny model."""

  name = "parity_addition"

  def reward(self, prompts, completions, answers):
    return [float(len(c) % 2 == 0) for c in completions]

  def extract_answer(self, text):
    return str(len(text) % 3) if text else None


def _hand(table, n, k):
  """pass@k and maj@k recomputed from a completions table, by the formulas."""
  from math import comb

  problems = sorted({r["problem"] for r in table})
  passes, hits = [], []
  for p in problems:
    rows = sorted((r for r in table if r["problem"] == p), key=lambda r: r["sample"])
    c = sum(r["correct"] for r in rows)
    passes.append(1.0 - comb(n - c, k) / comb(n, k))
    votes = {}
    for r in rows[:k]:
      if r["extracted"] is not None:
        votes.setdefault(r["extracted"], []).append(r)
    if votes:
      best = max(len(v) for v in votes.values())
      winner = min((v[0] for v in votes.values() if len(v) == best), key=lambda r: r["sample"])
      hits.append(winner["correct"])
    else:
      hits.append(False)
  return float(np.mean(passes)), float(np.mean(hits))


def test_run_eval_reports_at_k_consistent_with_its_table(tmp_path):
  from jetrl.sampling import GenerationConfig
  from jetrl.train import ModelSpec, TaskConfig
  from jetrl.train.evaluate import EvalRunConfig, run_eval

  lines = []
  cfg = EvalRunConfig(
    recipe="bf16",
    model=ModelSpec(n_layers=1),
    task=TaskConfig(difficulty=1, length=1),
    sampling=GenerationConfig(max_new_tokens=8),
    eval=EvalConfig(every=None, size=3, temperature=1.0, samples=4, k=(1, 4)),
    out=str(tmp_path / "result.json"),
  )
  res = run_eval(cfg, task=Parity(), log=lines.append)
  table = [json.loads(x) for x in open(tmp_path / "result.samples.jsonl")]
  assert len(table) == 3 * 4 and {r["sample"] for r in table} == {0, 1, 2, 3}
  for k in (1, 4):
    p, m = _hand(table, 4, k)
    assert res[f"eval_pass_at_{k}"] == pytest.approx(p) and res[
      f"eval_maj_at_{k}"
    ] == pytest.approx(m)
  assert 0 < res["eval_pass_at_1"] < 1  # verdicts that vary: the check is not 0 == 0
  line = next(x for x in lines if x.startswith("pass@1 "))
  assert line == (
    f"pass@1 {res['eval_pass_at_1']:.3f} maj@1 {res['eval_maj_at_1']:.3f} "
    f"pass@4 {res['eval_pass_at_4']:.3f} maj@4 {res['eval_maj_at_4']:.3f}"
  )
  saved = json.load(open(tmp_path / "result.json"))
  assert saved["eval_maj_at_4"] == res["eval_maj_at_4"]


def test_evaluate_script_prints_pass_and_maj_at_k(tmp_path, root):
  out = tmp_path / "samples.jsonl"
  cmd = [
    sys.executable,
    str(root / "experiments" / "evaluate.py"),
    "--recipe=bf16",
    "--model.n_layers=1",
    "--task.difficulty=1",
    "--task.length=1",
    "--sampling.max_new_tokens=8",
    "--eval.size=2",
    "--eval.temperature=1.0",
    "--eval.samples=4",
    "--eval.k=1,4",
    f"--samples_out={out}",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
  assert done.returncode == 0, done.stderr[-2000:]
  m = re.search(r"pass@1 (\S+) maj@1 (\S+) pass@4 (\S+) maj@4 (\S+)", done.stdout)
  assert m, done.stdout[-2000:]
  table = [json.loads(x) for x in open(out)]
  assert len(table) == 2 * 4
  for k, (p, q) in ((1, m.group(1, 2)), (4, m.group(3, 4))):
    hand_p, hand_m = _hand(table, 4, k)
    assert float(p) == pytest.approx(hand_p, abs=5e-4) and float(q) == pytest.approx(
      hand_m, abs=5e-4
    )
