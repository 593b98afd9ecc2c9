"""experiments/gradient_length.py: its random advantages and prefixes by hand, and a toy run
(a 2-layer random Llama as a Hugging Face folder, two questions, two samples each) where what
must hold whatever the weights is checked:
- jet_exact's rollout is its training forward bit for bit: its rows' sequence ESS is exactly 1,
  no token is truncated, mean |Δ| and k3 KL are exactly 0;
- under jet_exact the PPO ratio's two forwards agree bit for bit: no token is clipped at the
  first step, whether the old log-probs are recomputed or taken from the differentiated forward;
- a float32 trainer against the float32 reference is the same computation: cosine 1, 0 apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_mismatch_length import model_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import gradient_length as GL  # noqa: E402


def test_random_advantages_by_hand():
  adv = np.asarray(GL.random_advantages(8, 4, seed=3, kind="grpo"))
  # each group of 4 holds two rewards of 1 and two of 0: mean 1/2, sd 1/2 -> advantages +-1
  assert adv.shape == (8,)
  for g in adv.reshape(2, 4):
    assert sorted(np.round(g, 4)) == [-1.0, -1.0, 1.0, 1.0]
  again = np.asarray(GL.random_advantages(8, 4, seed=3, kind="grpo"))
  np.testing.assert_array_equal(adv, again)  # the same draw for every recipe
  # Dr.GRPO (no division by the sd); an odd group of 3 holds one reward of 1
  odd = np.asarray(GL.random_advantages(3, 3, seed=0, kind="dr_grpo"))
  np.testing.assert_allclose(sorted(odd), [-1 / 3, -1 / 3, 2 / 3], rtol=1e-6)


def test_prefix_batch_cuts_the_completion():
  class Out:
    prompt_tokens = np.array([[5, 6], [7, 8]])
    prompt_mask = np.ones((2, 2), bool)
    tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    logprobs = -np.arange(8, dtype=np.float32).reshape(2, 4)

  b = GL.prefix_batch(Out, np.array([1.0, -1.0]), 3, rows=slice(1, 2))
  assert np.asarray(b.mask).sum() == 3  # row 1's first three completion tokens
  np.testing.assert_array_equal(np.asarray(b.advantages), [-1.0])


@pytest.mark.slow
def test_gradient_length_at_toy_size(tmp_path):
  folder = model_folder(tmp_path / "model")
  questions = tmp_path / "questions.jsonl"
  questions.write_text(
    "\n".join(
      json.dumps({"question": q}) for q in ("tom has 3 apples and buys 4 more.", "add 2 and 5.")
    )
  )
  out = tmp_path / "g.json"
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), JAX_PLATFORMS="cpu")
  res = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "gradient_length.py"),
      f"--model.name={folder}",
      f"--gsm8k={questions}",
      "--prompts=2",
      "--sampling.n=2",
      "--lengths=6",
      "--recipes=jet_exact,fp32",
      f"--json_out={out}",
      f"--plot={tmp_path / 'g.png'}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert "| generated tokens | trainer (of recipe) |" in res.stdout
  results = json.load(open(out))["results"]
  assert [e["length"] for e in results] == [6]
  for e in results:
    assert e["tokens"] == 4 * e["length"]  # every row reaches the budget
    ex = e["recipes"]["jet_exact"]
    assert ex["sequence_ess"] == 1.0 and ex["tis_truncated"] == 0.0
    assert ex["abs_diff_mean"] == 0.0 and ex["kl_k3"] == 0.0
    t = e["trainers"]["jet_exact"]
    assert t["recompute"]["clipped"] == 0.0 and t["same_forward"]["clipped"] == 0.0
    assert t["recompute"]["cosine"] == pytest.approx(t["same_forward"]["cosine"], abs=1e-9)
    f = e["trainers"]["fp32"]["recompute"]
    assert f["cosine"] == pytest.approx(1.0, abs=1e-12) and f["rel_diff"] == 0.0
    assert -1.0 <= e["noise"]["half_cosine"] <= 1.0
  assert (tmp_path / "g.png").stat().st_size > 0
