"""experiments/prereg_judge.py on hand-made runs whose outcomes are known by hand: jet's
training reward 20 points under bf16's in every seed (a drop), jet_exact's equal to bf16's (no
drop), an exploratory arm reported and not judged, a seed cut short left out."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(root, arm, seed, reward, acc, kl=0.0):
  d = root / "L9" / arm / f"seed{seed}"
  d.mkdir(parents=True)
  recs = [
    {"step": s, "reward_mean": reward, "accuracy": reward, "agree/abs_diff_mean": 0.0,
     "agree/abs_diff_max": 0.0, "agree/seq_abs_sum_mean": 0.0, "agree/seq_abs_sum_max": 0.0,
     "agree/kl_k3": kl, "time/rollout": 1.0, "time/reward": 0.1, "time/update": 1.0}
    for s in range(1, 31)
  ]  # fmt: skip
  (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
  evals = [{"step": s, "eval_accuracy": acc, "eval_accuracy_bf16": acc} for s in (0, 10, 20, 30)]
  (d / "eval.jsonl").write_text("\n".join(json.dumps(e) for e in evals))
  (d / "summary.json").write_text("{}")


def test_judge_calls_by_hand(tmp_path):
  runs, extra = tmp_path / "runs", tmp_path / "extra"
  wobble = [0.00, 0.01, -0.01, 0.02]
  for s, w in enumerate(wobble):
    _run(runs, "bf16", s, 0.40 + w, 0.5 + w)
    _run(runs, "jet", s, 0.20 + w + 0.001 * s, 0.3 + w)  # 20 points lower, nearly constant
    _run(runs, "jet_exact", s, 0.40 + w, 0.5 + w)  # the same as bf16: differences all 0
    _run(extra, "fp8_rollout_e5m2", s, 0.35 + w, 0.45 + w, kl=0.08)
    _run(runs, "fp8_rollout", s, 0.40 + w, 0.5 + w, kl=0.001 * (s + 1))
  # Cut short in seed 5: bf16 and jet finished it, the other arms did not. The test is judged
  # on seeds 0-3; jet's 50-point gain at seed 5 must not count.
  _run(runs, "bf16", 5, 0.40, 0.5)
  _run(runs, "jet", 5, 0.90, 0.9)
  # A bf16 run kept beside the exploratory arm pairs with it at a seed the test has not run.
  _run(extra, "bf16", 4, 0.40, 0.5)
  _run(extra, "fp8_rollout_e5m2", 4, 0.35, 0.45, kl=0.08)
  # A bf16 run beside them at a seed the test ran too: the test's run is used, and only once.
  _run(extra, "bf16", 0, 0.90, 0.9)
  out = tmp_path / "v.json"
  res = subprocess.run(
    [sys.executable, "experiments/prereg_judge.py", f"--runs={runs}", f"--exploratory={extra}",
     f"--json_out={out}", "--dose=fp8_rollout,fp8_rollout_e5m2",
     f"--dose_plot={tmp_path / 'dose.png'}", "--seen_seeds=0,1"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert res.returncode == 0, res.stderr[-2000:]
  v = json.load(open(out))
  arms = v["primary"]["arms"]
  assert v["whole_seeds"] == [0, 1, 2, 3] and arms["jet"]["n"] == 4
  assert arms["jet"]["call"] == "drop"
  assert abs(arms["jet"]["mean"] - (-0.20 + 0.0015)) < 1e-6  # mean of 0.001 s over s = 0..3
  assert arms["jet_exact"]["call"] == "no drop" and arms["jet_exact"]["mean"] == 0.0
  # Holm over the three arms: the smallest p tripled (the others are 1)
  assert abs(arms["jet"]["p_holm"] - min(1.0, 3 * arms["jet"]["p"])) < 1e-12
  assert v["primary"]["attribution"] == "unresolved"  # jet drops; the crossover arms did not run
  assert abs(v["secondary"]["jet"]["mean"] - (-0.2)) < 1e-9
  e5 = v["exploratory"]["fp8_rollout_e5m2"]["primary"]
  assert e5["n"] == 5 and abs(e5["mean"] - (-0.05)) < 1e-9  # seed 4 against the kept bf16
  assert "bf16" not in v["exploratory"]
  # the crossover's contrasts need all four of its arms; two ran here
  assert v["crossover_post_hoc"]["primary"] == {} and v["crossover_unseen_seeds"]["primary"] == {}
  assert sorted(v["seeds"]["bf16"]) == [0, 1, 2, 3, 5] and v["baseline_seeds_beside"] == [4]
  assert "Exploratory (not judged)" in res.stdout
  bf16_runs = sorted(r["seed"] for r in v["runs"] if r["recipe"] == "bf16")
  assert bf16_runs == [0, 1, 2, 3, 4, 5] and "seeds [4]" in res.stdout
  assert sorted(v["seeds"]["jet"]) == [0, 1, 2, 3, 5]
  # the dose-response: each rollout's k3 KL, the mean of its runs' (by hand), and its interval
  fp8, e5 = v["dose"]
  assert fp8["label"] == "fp8_rollout" and abs(fp8["kl"] - 0.0025) < 1e-12
  assert fp8["diff"] == 0.0 and abs(e5["kl"] - 0.08) < 1e-12 and abs(e5["diff"] + 0.05) < 1e-9
  assert (tmp_path / "dose.png").stat().st_size > 0
