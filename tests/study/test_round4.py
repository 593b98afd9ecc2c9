"""The fourth round: its arms, its pre-registration check, its rules, its workers' claims."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from jetrl.config import ConfigError
from jetrl.study import StudyConfig, prereg4, round4
import socket

from jetrl.study.config import Arm, train_config
from jetrl.study.provenance import PreregError, check, precedes


# Arms ----------------------------------------------------------------------------------------


def test_recomputed_arm_is_labelled_and_sets_old_logp():
  assert Arm("bf16", old_logp="recompute").label == "bf16@recompute"
  assert Arm("fp8_rollout", "tis").label == "fp8_rollout+tis"
  cfg = round4.study_config("primary", 2, "/tmp/round4-test")
  assert [a.label for a in cfg.arms] == ["bf16", "bf16@recompute", "jet"]
  olds = {a.label: train_config(cfg, 9, a, 0).update.old_logp for a in cfg.arms}
  assert olds == {"bf16": "same_forward", "bf16@recompute": "recompute", "jet": "same_forward"}
  assert cfg.sft.seed == 2 and cfg.report_dir == "/tmp/round4-test/w2"


def test_recomputed_arm_needs_another_template_source():
  with pytest.raises(ConfigError, match="recomputed"):
    StudyConfig(recipes=("bf16",), recomputed=("bf16",), corrected=())


def test_the_rounds_jobs_are_in_the_registered_order():
  jobs = round4.jobs("/tmp/round4-test")
  names = [round4.job_name(j) for j in jobs]
  # primary: 9 seeds x 3 warm starts x 3 arms; crossover: 10 x 4; SmolLM2: 3 x 3; length: 6 x 3
  assert len(names) == 81 + 40 + 9 + 18
  assert names[:4] == [
    "w0/L9/bf16/seed0",
    "w0/L9/bf16@recompute/seed0",
    "w0/L9/jet/seed0",
    "w1/L9/bf16/seed0",
  ]
  assert names[81] == "w0/L9/jet_exact/seed0" and names[121] == "smollm2/bf16/seed0"
  assert names[-1] == "w0/L20/fp8_rollout/seed5"


def test_time_left_is_each_parts_jobs_times_its_median_timed_run(tmp_path):
  root = str(tmp_path)
  with open(os.path.join(root, "timing_w1.json"), "w") as f:
    json.dump({"w0/L9/bf16/seed0": 100.0, "w0/L9/jet/seed0": 300.0, "sft/w0/sft/x": 999.0}, f)
  with open(os.path.join(root, "timing_w2.json"), "w") as f:
    json.dump({"w0/L9/bf16@recompute/seed0": 200.0, "w0/L9/jet_exact/seed0": 50.0}, f)
  all_jobs = round4.jobs(root)
  todo = all_jobs[3:9] + all_jobs[81:85] + all_jobs[121:123]
  # primary: 6 jobs x median(100, 200, 300) = 1200 s; crossover: 4 x 50 = 200 s; 1400 s = 0.39 h
  assert round4.time_left(root, todo) == (
    "about 0.4 h of one worker's time at the pace so far, "
    "not counting jobs with no timed run yet (smollm2 2)"
  )
  assert round4.time_left(root, all_jobs[81:85]) == (
    "about 0.1 h of one worker's time at the pace so far"
  )


# Pre-registration ----------------------------------------------------------------------------


def _git(repo, *args):
  subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True)


@pytest.fixture()
def repo(tmp_path):
  r = str(tmp_path / "repo")
  os.makedirs(r)
  _git(r, "init", "-q")
  _git(r, "config", "user.email", "t@example.com")
  _git(r, "config", "user.name", "t")
  with open(os.path.join(r, "prereg.md"), "w") as f:
    f.write("design v1\n")
  return r


def test_prereg_must_be_committed_clean_and_unchanged(repo, tmp_path):
  doc = os.path.join(repo, "prereg.md")
  report = str(tmp_path / "report")
  with pytest.raises(PreregError, match="not committed"):
    check(report, [doc])
  assert not os.path.exists(report)
  _git(repo, "add", "prereg.md")
  _git(repo, "commit", "-qm", "prereg")
  first = check(report, [doc])
  assert os.path.exists(os.path.join(report, "prereg.json"))
  assert check(report, [doc])["commit"] == first["commit"]  # a second sitting: accepted
  with open(doc, "a") as f:
    f.write("edited\n")
  with pytest.raises(PreregError, match="uncommitted changes"):
    check(report, [doc])
  _git(repo, "commit", "-qam", "edit the design")
  with pytest.raises(PreregError, match="changed since its first run"):
    check(report, [doc])
  # git order: the registering commit precedes the edit, not the reverse
  head = subprocess.run(
    ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  assert precedes(repo, first["commit"], head)
  assert not precedes(repo, head, first["commit"])


# Rules ---------------------------------------------------------------------------------------


def _t_interval(d):
  d = np.asarray(d, np.float64)
  n, m, s = len(d), d.mean(), d.std(ddof=1)
  half = stats.t.ppf(0.975, n - 1) * s / math.sqrt(n)
  return m, m - half, m + half


def _row(recipe, warm, seed, acc, length=9, dose=0.0):
  # held-out accuracy (bf16-scored) at steps 0, 10, 20, 30: the primary outcome is the mean of
  # the last three; the training reward is constant, so the secondary is that constant
  return dict(
    recipe=recipe,
    warm=warm,
    seed=seed,
    length=length,
    eval_steps=[0, 10, 20, 30],
    eval_accuracy_bf16=[0.2, acc - 0.01, acc, acc + 0.01],
    reward_series=[acc] * 30,
    abs_diff_mean=dose,
  )


def test_calls_follow_the_margin():
  assert prereg4.call(dict(lo=-0.049, hi=0.02, p=0.5))["call"] == "non-inferior"
  assert prereg4.call(dict(lo=-0.2, hi=-0.051, p=0.001))["call"] == "inferior"
  v = prereg4.call(dict(lo=-0.08, hi=-0.01, p=0.01))
  assert v["call"] == "inconclusive" and v["drop_shown"]
  assert not prereg4.call(dict(lo=-0.08, hi=-0.01, p=0.01), p=0.06)["drop_shown"]


def test_primary_pools_warm_starts_on_whole_units():
  base = {(w, s): 0.4 + 0.01 * s + 0.02 * w for w in range(3) for s in range(4)}
  diff = {(w, s): 0.01 * ((s * 7 + w * 3) % 5) - 0.02 for w in range(3) for s in range(4)}
  rows = []
  for (w, s), b in base.items():
    rows.append(_row("bf16", w, s, b))
    rows.append(_row("bf16@recompute", w, s, b - 0.01))
    if (w, s) != (2, 3):  # a unit jet has not finished is left out of every comparison
      rows.append(_row("jet", w, s, b + diff[w, s]))
  out = prereg4.judge_primary(rows)
  units = [k for k in sorted(base) if k != (2, 3)]
  assert out["units"] == [list(u) for u in units]
  m, lo, hi = _t_interval([diff[k] for k in units])
  assert out["primary"]["mean"] == pytest.approx(m, abs=1e-12)
  assert out["primary"]["lo"] == pytest.approx(lo, abs=1e-12)
  assert out["primary"]["hi"] == pytest.approx(hi, abs=1e-12)
  assert out["primary"]["call"] == ("non-inferior" if lo > -0.05 else "inconclusive")
  m1, lo1, hi1 = _t_interval([diff[1, s] for s in range(4)])
  assert out["per_warm_start"]["1"]["lo"] == pytest.approx(lo1, abs=1e-12)
  f = stats.f_oneway(*[[diff[w, s] for s in range(4) if (w, s) != (2, 3)] for w in range(3)])
  assert out["heterogeneity"]["p"] == pytest.approx(f.pvalue, rel=1e-9)
  # bf16 - bf16@recompute is 0.01 on every unit: sd 0, p 0, a shown difference (not a drop)
  fam = out["secondary_family"]["bf16 - bf16@recompute"]
  assert fam["mean"] == pytest.approx(0.01) and not fam["drop_shown"]


def test_a_clear_drop_on_one_warm_start_means_it_does_not_hold_everywhere():
  rows = []
  for w in range(3):
    for s in range(6):
      b = 0.5 + 0.003 * s
      rows += [_row("bf16", w, s, b), _row("bf16@recompute", w, s, b)]
      rows.append(_row("jet", w, s, b - (0.2 + 0.01 * (s % 2) if w == 2 else 0.001 * (s % 3))))
  out = prereg4.judge_primary(rows)
  assert out["warm_starts_below_margin"] == [2]
  assert not out["holds_on_each_warm_start"]


def test_crossover_verdicts_and_doses():
  rows = []
  for s in range(6):
    rows.append(_row("jet_exact", 0, s, 0.5 + 0.01 * s, dose=0.0))
    rows.append(_row("jet_exact_train", 0, s, 0.5 + 0.01 * s + 0.002 * (s % 2), dose=2e-4))
    rows.append(
      _row("jet_exact_train_bf16_rollout", 0, s, 0.5 + 0.01 * s - 0.003 * (s % 3), dose=3e-3)
    )
    rows.append(
      _row("jet_exact_train_e5m2_rollout", 0, s, 0.3 + 0.01 * s - 0.01 * (s % 2), dose=9e-3)
    )
  out = prereg4.judge_crossover(rows)
  assert out["verdict"] == "mismatch effect shown"
  assert out["dose"]["jet_exact_train_e5m2_rollout"] == pytest.approx(9e-3)
  m, lo, hi = _t_interval([-0.2 - 0.01 * (s % 2) for s in range(6)])
  assert out["arms"]["jet_exact_train_e5m2_rollout"]["mean"] == pytest.approx(m)
  assert out["arms"]["jet_exact_train"]["call"] == "non-inferior"


def test_smollm2_gains_pair_by_seed():
  rows = [
    dict(recipe="bf16", seed=0, before=0.3, after=0.7),
    dict(recipe="bf16", seed=1, before=0.2, after=0.5),
    dict(recipe="jet", seed=0, before=0.3, after=0.6),
    dict(recipe="jet", seed=1, before=0.2, after=0.6),
  ]
  out = prereg4.judge_smollm2(rows)
  assert out["gain"]["bf16"]["mean"] == pytest.approx(0.35)
  assert out["against_bf16"]["jet"]["mean"] == pytest.approx(((0.3 - 0.4) + (0.4 - 0.3)) / 2)


# Claims --------------------------------------------------------------------------------------


def test_claims_exclude_live_workers_and_take_over_dead_ones(tmp_path):
  folder = str(tmp_path / "runs" / "L9" / "bf16" / "seed0")
  assert round4.claim(folder)
  assert not round4.claim(folder)  # held by this (live) process
  round4.release(folder)
  dead = subprocess.Popen(["true"])
  dead.wait()
  with open(folder + ".claim", "w") as f:
    json.dump({"pid": dead.pid, "host": socket.gethostname()}, f)
  assert round4.claim(folder)  # its process is gone
  round4.release(folder)
  assert not os.path.exists(folder + ".claim")


# Keep and judge --------------------------------------------------------------------------------


def _fake_run(folder, acc, commit, cpu_model="17"):
  os.makedirs(folder)
  recs = [
    {"step": s, "reward_mean": acc, "accuracy": acc, "agree/abs_diff_mean": 1e-3,
     "agree/abs_diff_max": 0.0, "agree/seq_abs_sum_mean": 0.0, "agree/seq_abs_sum_max": 0.0,
     "agree/kl_k3": 0.0, "time/rollout": 1.0, "time/reward": 0.1, "time/update": 1.0}
    for s in range(1, 31)
  ]  # fmt: skip
  with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in recs))
  with open(os.path.join(folder, "eval.jsonl"), "w") as f:
    evals = [{"step": s, "eval_accuracy": acc, "eval_accuracy_bf16": acc} for s in (0, 10, 20, 30)]
    f.write("\n".join(json.dumps(e) for e in evals))
  for name, text in (("summary.json", "{}"), ("config.json", "{}"), ("commit.txt", commit)):
    with open(os.path.join(folder, name), "w") as f:
      f.write(text)
  with open(os.path.join(folder, "machine.json"), "w") as f:
    json.dump({"vendor_id": "AuthenticAMD", "cpu_family": "25", "model": cpu_model}, f)


def test_keep_copies_what_the_judge_reads_and_the_judge_pairs_units(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  head = subprocess.run(
    ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
  ).stdout.strip()
  root, kept = str(tmp_path / "root"), str(tmp_path / "kept")
  diffs = {(0, 0): 0.02, (0, 1): -0.01, (1, 0): 0.00, (1, 1): 0.03}
  for (w, s), d in diffs.items():
    cfg = round4.study_config("primary", w, root)
    for arm in cfg.arms:
      acc = 0.5 + 0.01 * s + (d if arm.label == "jet" else 0.0)
      # unit (1, 1)'s jet ran on another model of CPU: a mixed unit
      model = "2" if (w, s, arm.label) == (1, 1, "jet") else "17"
      _fake_run(round4.run_dir(cfg, 9, arm, s), acc, head, model)
    sft = os.path.join(cfg.report_dir, "sft", "mix3_9")
    os.makedirs(os.path.join(sft, "checkpoints", "300", "params"), exist_ok=True)
    with open(os.path.join(sft, "checkpoints", "300", "params", "blob"), "w") as f:
      f.write("weights")
    with open(os.path.join(sft, "sft_summary.json"), "w") as f:
      f.write('{"eval_accuracy": 0.4}')
  # warm start 2's gate run answered nothing before RL and was stopped (no summary): left out
  gate = os.path.join(root, "w2", "runs", "L9", "bf16", "seed0")
  os.makedirs(gate)
  with open(os.path.join(gate, "eval.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "eval_accuracy": 0.0, "eval_accuracy_bf16": 0.0}) + "\n")
  assert round4.primary_warm_starts(root) == ((0, 1, 3), (2,))
  with open(os.path.join(root, "prereg.json"), "w") as f:
    json.dump({"commit": head, "head": head, "blobs": {}}, f)
  # SmolLM2: seeds 0 and 1 of each recipe, as experiments/lora_arithmetic.py records them
  smol = {("bf16", 0): (0.30, 0.50), ("bf16", 1): (0.20, 0.30), ("jet", 0): (0.25, 0.55)}
  smol |= {("jet", 1): (0.25, 0.45), ("fp8_rollout", 0): (0.30, 0.40)}
  smol |= {("fp8_rollout", 1): (0.20, 0.40)}
  for (recipe, seed), (before, after) in smol.items():
    folder = round4.smollm2_dir(root, recipe, seed)
    _fake_run(folder, after, head, "17")
    with open(folder + ".json", "w") as f:
      json.dump({"rows": [{"seed": seed, "before": before, "after": after, "minutes": 1.0}]}, f)
  script = os.path.join(repo, "experiments", "round4.py")
  run = lambda *a: subprocess.run(
    [sys.executable, script, *a], cwd=repo, capture_output=True, text=True, timeout=300
  )
  with open(os.path.join(root, "timing_w1.json"), "w") as f:
    json.dump({"w0/L9/bf16/seed0": 300.0, "w0/L9/jet/seed0": 600.0, "w1/L9/jet/seed1": 900.0}, f)
  res = run(f"--root={root}", "--plan")
  assert res.returncode == 0, res.stderr[-2000:]
  # 12 of the primary's 81 runs done: 69 left x the median timed run (600 s) = 11.5 h; 6 of
  # SmolLM2's 9 done
  assert res.stdout.splitlines()[-1] == (
    "130 jobs to run: about 11.5 h of one worker's time at the pace so far, not counting jobs "
    "with no timed run yet (crossover 40, smollm2 3, length 18)"
  )
  # the length part's warm start answers nothing at length 20: its 18 runs are not run
  length_sft = round4.length_warm_start_dir(root)
  os.makedirs(os.path.join(length_sft, "checkpoints", "400"))
  for name, text in (("sft_summary.json", '{"eval_accuracy": 0.0}'), ("sft_metrics.jsonl", "{}")):
    with open(os.path.join(length_sft, name), "w") as f:
      f.write(text)
  gate_note = (
    "not run: its warm start's held-out accuracy at length 20 is 0.000, below the gate 0.05"
  )
  res = run(f"--root={root}", "--plan")
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.splitlines()[-2:] == [
    "112 jobs to run: about 11.5 h of one worker's time at the pace so far, not counting jobs "
    "with no timed run yet (crossover 40, smollm2 3)",
    f"the length part's 18 jobs: {gate_note}",
  ]
  res = run(f"--root={root}", f"--keep={kept}")
  assert res.returncode == 0, res.stderr[-2000:]
  # the gate's evidence is kept (the kept folder decides the gate as the runs did), not its
  # checkpoint (it serves no run)
  kept_sft = round4.length_warm_start_dir(kept)
  assert sorted(os.listdir(kept_sft)) == ["sft_metrics.jsonl", "sft_summary.json"]
  assert round4.length_gate(kept) is False
  assert os.path.exists(
    os.path.join(kept, "w1", "sft", "mix3_9", "checkpoints", "300", "params", "blob")
  )
  assert os.path.exists(
    os.path.join(kept, "w0", "runs", "L9", "bf16@recompute", "seed1", "machine.json")
  )
  # the kept folder decides the gate as the runs did, though w2's gate run did not finish
  assert round4.primary_warm_starts(kept) == ((0, 1, 3), (2,))
  out, rep = str(tmp_path / "v.json"), str(tmp_path / "report")
  res = run(f"--judge={kept}", f"--json_out={out}", f"--report={rep}")
  assert res.returncode == 0, res.stderr[-2000:]
  with open(out) as f:
    v = json.load(f)
  with open(os.path.join(rep, "verdicts.json")) as f:
    assert json.load(f) == v
  # the report: 12 of the primary's 81 runs are done, said as interim; the table's interval is
  # the hand-computed one in points; the learning curves are drawn (PNG files)
  with open(os.path.join(rep, "results.md")) as f:
    md = f.read()
  m, lo, hi = _t_interval(list(diffs.values()))
  assert f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] (n = 4)" in md
  assert "**Interim:** primary: 12 of 81 runs" in md and "crossover: 0 of 40 runs" in md
  assert (
    "**Not run, by its pre-registered gate:** length (0 of 18 runs): its warm start's held-out "
    "accuracy at length 20 is 0.000, below the gate 0.05 (prereg.md, *The length*)." in md
  )
  assert "**Interim:** primary: 12 of 81 runs; crossover: 0 of 40 runs; smollm2: 6 of 9 runs." in md
  assert v["progress"]["length"] == dict(done=0, planned=18, note=gate_note)
  # SmolLM2: jet's gains 30 and 20 points (t interval 25 +- 12.706 x 7.07 / sqrt 2), bf16's
  # 20 and 10: +10 [+10, +10] over bf16
  m, lo, hi = _t_interval([0.55, 0.45])
  assert (
    f"| jet | 0.250 / 0.250 | 0.550 / 0.450 | 0.250 [0.250, 0.250] | {m:.3f} [{lo:.3f}, {hi:.3f}] "
    "| +25.0 [-38.5, +88.5] (n = 2) | +10.0 [+10.0, +10.0] (n = 2) |" in md
  )
  for name in ("primary_curves.png", "effects.png"):
    with open(os.path.join(rep, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"![{name}]({name})" in md
  assert not os.path.exists(os.path.join(rep, "dose_effect.png"))  # no crossover run yet
  res = run(f"--report={rep}")
  assert res.returncode != 0 and "--report writes the judge's report" in res.stderr
  m, lo, hi = _t_interval(list(diffs.values()))
  p = v["primary"]["primary"]["primary"]
  assert p["n"] == 4 and p["mean"] == pytest.approx(m) and p["lo"] == pytest.approx(lo)
  assert v["machines"]["primary"]["mixed_units"] == [[1, 9, 1]]
  assert v["primary_one_machine_kind"]["primary"]["n"] == 3
  # bf16@recompute equals bf16 in every unit: the difference is 0
  assert v["primary"]["primary"]["secondary_family"]["bf16 - bf16@recompute"]["mean"] == 0.0


def test_a_warm_start_that_answers_nothing_is_replaced_by_the_next_seed(tmp_path):
  root = str(tmp_path / "root")
  assert round4.primary_warm_starts(root) == ((0, 1, 2), ())  # nothing known yet: as designed
  for warm, acc in ((0, 0.30), (1, 0.0), (2, 0.049)):
    d = os.path.join(root, f"w{warm}", "runs", "L9", "bf16", "seed0")
    os.makedirs(d)
    with open(os.path.join(d, "eval.jsonl"), "w") as f:
      f.write(json.dumps({"step": 0, "eval_accuracy": acc, "eval_accuracy_bf16": acc}) + "\n")
  # w1 and w2 answer fewer than 5% of the length-9 problems before RL: left out, w3 and w4 in
  assert round4.primary_warm_starts(root) == ((0, 3, 4), (1, 2))
  names = [round4.job_name(j) for j in round4.jobs(root) if j["part"] == "primary"]
  assert len(names) == 81 and names[3] == "w3/L9/bf16/seed0"
  assert not any(n.startswith(("w1/", "w2/")) for n in names)
  kept = [round4.job_name(j) for j in round4.jobs(root, left_out=True) if j["part"] == "primary"]
  assert len(kept) == 135 and "w1/L9/jet/seed8" in kept


def test_a_warm_starts_evaluation_at_its_length_is_its_own_sft_evaluation(
  tmp_path, tiny_sft_config
):
  """round4.warm_start_eval samples as the SFT's own evaluation does: at the SFT's length it
  gives the sft_summary.json that run_sft wrote (accuracy and mean completion length, exactly)."""
  from jetrl.train import EvalConfig, run_sft

  sft = tiny_sft_config(tmp_path, eval=EvalConfig(every=None, size=4, temperature=0.7, samples=2))
  run_sft(sft, log=lambda *a, **k: None)
  with open(tmp_path / "sft_summary.json") as f:
    own = json.load(f)
  res = round4.warm_start_eval(sft, sft.task.length)
  assert (res["eval_accuracy"], res["eval_length"]) == (own["eval_accuracy"], own["eval_length"])
  assert own["eval_length"] > 0
