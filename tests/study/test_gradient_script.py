"""experiments/gradient_study.py at toy size: its JSON, and what must hold whatever the
weights: a bitwise rollout (jet_exact) gives exactly the training forward's own rows."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gradient_study_toy(tmp_path):
  out = tmp_path / "g.json"
  cmd = [
    sys.executable,
    "experiments/gradient_study.py",
    "--lengths=1",
    "--batches=2",
    "--prompts=2",
    "--sampling.n=4",
    "--sampling.temperature=1.0",
    "--recipes=bf16,jet_exact",
    f"--json_out={out}",
  ]
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
  res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "| length | recipe |" in res.stdout
  (r,) = json.load(open(out))["results"]
  ex = r["recipes"]["jet_exact"]
  assert ex["rows_identical"]["mean"] == 1.0
  assert ex["abs_diff_mean"]["mean"] == 0.0 and ex["sequence_ess"]["mean"] == 1.0
  assert r["trainers"]["jet_exact"]["passes"]["mean"] == 1.0
  assert r["trainers"]["jet_exact"]["clipped"]["mean"] == 0.0
  for t in r["trainers"].values():
    if t["flat_groups"]["mean"] == 1.0:  # a random model: every reward equal, no gradient
      assert t["grad_norm"]["mean"] == 0.0
    else:
      assert -1.0 <= t["split_half_cosine"]["mean"] <= 1.0
  assert len(r["per_batch"]["recipes"]["bf16"]) == 2
