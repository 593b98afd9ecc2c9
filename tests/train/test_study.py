"""The precision-flow study: the paired statistics and the verdict rules against hand-computed
values, then a toy-size run (report structure, resume, mismatch ordering), the flags, and
experiments/gpu_study.py's configuration and deadlines."""

import json
import math
import subprocess
import sys

import jax
import pytest

from conftest import quiet
from jetrl.config import ConfigError
from jetrl.study import (
  ACCURACY_HEADER,
  MISMATCH_HEADER,
  Arm,
  StudyConfig,
  aggregate,
  format_table,
  max_new_tokens_for,
  paired_interval,
  run_settings,
  run_study,
  set_by_study,
  sft_config,
  sft_settings,
  train_config,
  verdicts,
)
from jetrl.study.config import combinations, flag_error


def test_paired_interval_hand_values():
  # d = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1 / sqrt 3; t(0.975, 2 df) = 4.302653;
  # t = 2 sqrt 3, and for 2 df the two-sided p is 1 - t / sqrt(2 + t^2) = 1 - sqrt(12 / 14).
  c = paired_interval([0.1, 0.2, 0.3])
  half = 4.302653 * 0.1 / math.sqrt(3)
  assert c["n"] == 3 and c["mean"] == pytest.approx(0.2) and c["sd"] == pytest.approx(0.1)
  assert (c["lo"], c["hi"]) == (pytest.approx(0.2 - half, abs=1e-6), pytest.approx(0.2 + half))
  assert c["p"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-6)
  one = paired_interval([0.4])
  assert one["mean"] == 0.4 and math.isnan(one["lo"]) and math.isnan(one["p"])
  assert paired_interval([])["n"] == 0


# What every hand-made row of a length-3 run has in common.
ROW = {"length": 3, "max_new_tokens": 57, "steps_to_target": None, "diverged": False}
ROW |= {"diverged_why": [], "abs_diff_max": 1.0, "seq_abs_sum_max": 1.0, "ratio_out_frac": 0.0}
ROW |= {"reward_last": 0.5, "response_length": 40.0, "wall_s": 10.0}
ROW |= {"time_rollout": 1.0, "time_reward": 0.0, "time_update": 1.0}


def _row(recipe, seed, init, final, mismatch):
  """A finished run's row: accuracies `init` -> `final` (the same scored own and bf16), every
  mismatch measure `mismatch`."""
  return {
    **ROW,
    "recipe": recipe,
    "seed": seed,
    **dict.fromkeys(("eval_initial", "eval_initial_bf16"), init),
    **dict.fromkeys(("eval_final", "eval_final_bf16"), final),
    **dict.fromkeys(("abs_diff_mean", "seq_abs_sum_mean", "kl_k3"), mismatch),
  }


def _grid(bf16_final, off_final, jet_final, off_mismatch=3e-3):
  seeds = range(5)
  return (
    [_row("bf16", s, 0.40, bf16_final[s], 1e-3) for s in seeds]
    + [_row("fp8_rollout", s, 0.40, off_final[s], off_mismatch) for s in seeds]
    + [_row("jet", s, 0.40, jet_final[s], 2e-3) for s in seeds]
  )


def test_verdict_rules():
  bf16 = [0.60, 0.55, 0.58, 0.62, 0.57]
  # fp8_rollout 4 to 6 points below bf16 in every seed, jet within a point either way.
  rows = _grid(
    bf16,
    [b - d for b, d in zip(bf16, (0.05, 0.04, 0.06, 0.05, 0.05))],
    [b + d for b, d in zip(bf16, (0.01, -0.01, 0.0, 0.01, -0.01))],
  )
  v = verdicts(rows, aggregate(rows), 3)
  assert (v["valid"], v["mechanism"], v["central"]) == ("valid", "confirmed", "confirmed")
  off = next(a for a in aggregate(rows) if a["recipe"] == "fp8_rollout")
  assert off["vs_bf16"]["mean"] == pytest.approx(-0.05) and off["gain_bf16"]["mean"] > 0.1
  # The same gaps from a bf16 that gained 2 points: not valid, the central claim not judged.
  flat = [0.42, 0.41, 0.43, 0.42, 0.42]
  rows = _grid(flat, [b - 0.05 for b in flat], flat)
  v = verdicts(rows, aggregate(rows), 3)
  assert v["valid"].startswith("invalid") and v["central"] == "not judged"
  # fp8_rollout within a point of bf16 in every seed: no 3-point drop fits the interval.
  rows = _grid(
    bf16, [b + d for b, d in zip(bf16, (0.01, -0.01, 0.0, 0.005, -0.005))], bf16, off_mismatch=5e-4
  )
  v = verdicts(rows, aggregate(rows), 3)
  assert (v["central"], v["mechanism"]) == ("refuted at this scale", "not confirmed")
  # A wide interval that holds both 0 and a large drop.
  rows = _grid(bf16, [b + d for b, d in zip(bf16, (0.1, -0.15, 0.05, -0.1, 0.0))], bf16)
  assert verdicts(rows, aggregate(rows), 3)["central"] == "inconclusive"


def _labels(cfg):
  return [arm.label for arm in cfg.arms]


def test_arms_budget_and_combination_configs(tiny_study_config):
  # The design's arms: each recipe, and fp8_rollout again with TIS, right after its own.
  assert _labels(StudyConfig()) == ["bf16", "fp8_rollout", "fp8_rollout+tis", "jet", "jet_exact"]
  assert Arm("jet").label == "jet" and str(Arm("fp8_rollout", "tis")) == "fp8_rollout+tis"
  assert _labels(StudyConfig(recipes=("bf16", "jet"))) == ["bf16", "jet"]
  assert _labels(StudyConfig(corrected=("jet",), correction="mis")) == [
    "bf16",
    "fp8_rollout",
    "jet",
    "jet+mis",
    "jet_exact",
  ]
  with pytest.raises(ConfigError, match="recipes: 'fp9': unknown recipe"):
    StudyConfig(recipes=("jet", "fp9"))
  with pytest.raises(ConfigError, match="recipes: 'fp8_rollout\\+tis': unknown recipe"):
    StudyConfig(recipes=("fp8_rollout+tis",))
  with pytest.raises(ConfigError, match="correction: 'foo' is not accepted"):
    StudyConfig(correction="foo")
  with pytest.raises(ConfigError, match="correction: 'none' is not accepted"):
    StudyConfig(correction="none")
  cfg = tiny_study_config("x")
  assert max_new_tokens_for(cfg, 1) == 21 + 1 + 2  # longest gold completion + eos + margin
  tis = cfg.replace(recipes=("fp8_rollout",), corrected=("fp8_rollout",))
  run_cfg = train_config(tis, 1, tis.arms[1], 3)
  assert (run_cfg.recipe, run_cfg.update.is_method, run_cfg.seed) == ("fp8_rollout", "tis", 3)
  assert run_cfg.workdir.endswith("runs/L1/fp8_rollout+tis/seed3")
  assert (run_cfg.task.length, run_cfg.sampling.max_new_tokens) == (1, 24)
  assert run_cfg.optimizer is cfg.optimizer and run_cfg.init_from.endswith("sft/L1")
  with pytest.raises(ConfigError, match=r"lengths: 0: must be in \[1, 300\]"):
    cfg.replace(lengths=(0,))
  with pytest.raises(ConfigError, match="task.name: 'gsm8k' is not a synthetic task"):
    cfg.replace(task={"name": "gsm8k"})
  assert run_cfg.eval.also_bf16 and run_cfg.update.old_logp == "recompute"
  with pytest.raises(
    ConfigError,
    match=r"update.old_logp: 'rollout' cannot be combined with the correction of 'fp8_rollout\+tis'",
  ):
    tis.replace(update={"old_logp": "rollout"})
  # One warm start shared by every length: the runs of length 2 start from the length-1 one.
  shared = cfg.replace(lengths=(1, 2), sft={"length": 1})
  assert train_config(shared, 2, Arm("jet"), 0).init_from.endswith("sft/L1")
  assert sft_config(shared, 2).task.length == 1
  # One warm start trained on every length in turn, with the budget of the longest.
  mixed = cfg.replace(lengths=(1, 2), sft={"mix": True})
  assert train_config(mixed, 2, Arm("jet"), 0).init_from.endswith("sft/mix1_2")
  warm = sft_config(mixed, 2)
  assert (warm.mix_lengths, warm.task.length) == ((1, 2), 1)
  assert warm.sampling.max_new_tokens == max_new_tokens_for(cfg, 2) > max_new_tokens_for(cfg, 1)
  with pytest.raises(ConfigError, match="mix: trains on every length"):
    cfg.replace(sft={"mix": True, "length": 1})
  # Runs at one length from a warm start mixed over more: the runs of 2 from the one of 1 and 2.
  only_2 = cfg.replace(lengths=(2,), sft={"mix": True, "lengths": (1, 2)})
  assert train_config(only_2, 2, Arm("jet"), 0).init_from.endswith("sft/mix1_2")
  assert [c[0] for c in combinations(only_2)] == [2] * len(combinations(only_2))
  warm = sft_config(only_2, 2)
  assert (warm.mix_lengths, warm.task.length) == ((1, 2), 1)
  assert warm.sampling.max_new_tokens == max_new_tokens_for(cfg, 2)
  with pytest.raises(
    ConfigError, match=r"sft.lengths: must include every length of --lengths.*2 missing from 1,3"
  ):
    cfg.replace(lengths=(2,), sft={"mix": True, "lengths": (1, 3)})
  with pytest.raises(
    ConfigError, match="lengths: names the lengths of a mixed warm start; set --sft.mix"
  ):
    cfg.replace(sft={"lengths": (1, 2)})


def test_a_combinations_error_names_the_field_of_the_study_that_set_it(tiny_study_config):
  """What a combination refuses is reported under the study's flag: the field that set the
  failing one (an axis, or a node the study hands on), else the template's own path."""
  cfg = tiny_study_config("x", lengths=(1, 2))
  run = run_settings(cfg, 2, cfg.arms[0], 0)
  warm = sft_settings(cfg, 2)
  shared = sft_settings(cfg.replace(sft={"length": 1}), 2)

  def named(settings, prefix, failing):
    """The flags named for the failing fields `failing` (space-separated)."""
    paths = (flag_error(ConfigError(p, "bad"), settings, prefix, "w").path for p in failing.split())
    return " ".join(paths)

  # A run's field keeps its path; one the grid sets names the study's field that set it.
  assert (
    named(run, "", "sampling.temperature sampling.max_new_tokens task.length recipe seed")
    == "sampling.temperature token_margin lengths recipes seeds"
  )
  assert named(run, "", "update.is_method update.loss") == "correction update.loss"
  # A warm start's field is under --sft.; the model, task and evaluation are the study's own.
  assert (
    named(warm, "sft.", "optimizer.lr steps sampling.max_new_tokens mix_lengths task.length")
    == "sft.optimizer.lr sft.steps token_margin lengths lengths"
  )
  assert named(warm, "sft.", "task.difficulty eval.size") == "task.difficulty eval.size"
  assert named(shared, "sft.", "task.length") == "sft.length"
  assert (
    str(flag_error(ConfigError("seed", "bad"), run, "", "the run x")) == "--seeds: bad (the run x)"
  )
  assert str(flag_error(ConfigError(None, "bad"), run, "", "the run x")) == "bad (the run x)"
  # What the study sets is what it leaves out of its flags.
  grid = set(set_by_study(cfg))
  assert {p for _, sets in run for p in sets} | {
    "sft." + p for _, sets in warm for p in sets
  } == grid


def test_committed_studies_re_report_identically(root):
  """The results of docs/study/*/ (rows named by their arms' labels, fp8_rollout+tis among them)
  give their committed verdicts again, one table line per arm in the order the same grid runs
  them today."""
  for name, cfg in (
    ("a_length3", StudyConfig()),
    ("b_lengths", StudyConfig(recipes=("bf16", "fp8_rollout", "jet", "jet_exact"), corrected=())),
  ):
    study = root / "docs" / "study" / name
    saved = json.loads((study / "study_config.json").read_text())
    assert _labels(cfg) == saved["recipes"], name
    rows = json.loads((study / "results.json").read_text())
    agg = aggregate(rows)
    for length, v in json.loads((study / "verdicts.json").read_text()).items():
      assert verdicts(rows, agg, int(length)) == v, (name, length)
      table = format_table([a for a in agg if a["length"] == int(length)])
      assert [line.split(" | ")[0][2:] for line in table.splitlines()[2:]] == _labels(cfg)


def _gpu_study(root):
  """experiments/gpu_study.py as a module."""
  import importlib.util

  if "gpu_study" not in sys.modules:
    spec = importlib.util.spec_from_file_location(
      "gpu_study", root / "experiments" / "gpu_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_study"] = module  # before it runs: its dataclasses look themselves up there
    spec.loader.exec_module(module)
  return sys.modules["gpu_study"]


def _gpu_toy(root, out, seeds=(0,)):
  """The toy configuration of experiments/configs/gpu_study_toy.py, as --config reads it, with
  the arms fp8_rollout and jet, sampled and evaluated at temperature 0.7."""
  from jetrl.config.flags import load_config_file

  gs = _gpu_study(root)
  toy = load_config_file(
    str(root / "experiments" / "configs" / "gpu_study_toy.py"), gs.GPUStudyConfig()
  )
  return toy.replace(
    out=str(out),
    workers=1,
    recipes=("fp8_rollout", "jet"),
    corrected=(),
    seeds=seeds,
    sampling={"temperature": 0.7},
    eval={"temperature": 0.7},
  )


def test_gpu_study_flags_are_config_paths_with_the_gpu_design_defaults(root):
  from absl import flags

  from jetrl.config.flags import config_from_flags, define_flags

  gs = _gpu_study(root)
  d = gs.GPUStudyConfig()
  # The GPU design (docs/precision_study.md), written out.
  assert _labels(d) == ["bf16", "fp8_rollout", "fp8_rollout+tis", "jet"]
  assert (d.seeds, d.steps, d.prompts_per_step, d.token_margin) == ((0, 1, 2, 3, 4), 24, 16, 8)
  assert d.model.n_layers == 4 and (d.task.name, d.task.difficulty) == ("addition", 1)
  assert (d.sampling.n, d.sampling.temperature, d.optimizer.lr) == (8, 0.5, 5e-5)
  assert (d.eval.size, d.eval.samples, d.eval.temperature, d.eval.batch) == (256, 4, 0.5, 256)
  assert (d.sft.steps, d.sft.batch_size, d.sft.answer_noise) == (100, 32, 0.5)
  assert (d.sft.optimizer.lr, d.sft.optimizer.warmup_steps) == (1e-3, 20)
  assert d.sft.optimizer.schedule == "constant"
  assert (d.sft.target, d.sft.max_steps, d.sft.budget_s) == (0.3, 3000, 150.0)
  assert (d.workers, d.start_by_s, d.end_by_s, d.min_tokens, d.length) == (4, 400, 480, 1024, None)

  fv = flags.FlagValues()
  names = set(define_flags(d, fv, exclude=gs.EXCLUDE))
  fv(
    [
      "prog",
      "--out=/tmp/o",
      "--sampling.n=4",
      "--sampling.temperature=0.7",
      "--eval.temperature=0.7",
      "--optimizer.lr=1e-4",
      "--eval.size=64",
      "--sft.optimizer.lr=2e-3",
      "--sft.steps=50",
      "--sft.target=0.5",
      "--end_by_s=500",
      "--length=9",
      "--recipes=bf16,jet",
    ]
  )
  cfg = config_from_flags(d, fv, exclude=gs.EXCLUDE)
  assert cfg.out == "/tmp/o" and cfg.sampling.n == 4 and cfg.optimizer.lr == 1e-4
  assert cfg.sampling.temperature == 0.7 and cfg.eval.temperature == 0.7 and cfg.eval.size == 64
  assert cfg.sft.optimizer.lr == 2e-3 and cfg.sft.steps == 50 and cfg.sft.target == 0.5
  assert cfg.end_by_s == 500 and cfg.length == 9 and cfg.recipes == ("bf16", "jet")
  assert cfg.sft.optimizer.warmup_steps == 20 and cfg.steps == 24  # not given: the design's
  # What the script sets itself is not a flag.
  assert not names & {"lengths", "report_dir", "time_budget_s", "quiet_runs", "sft.mix"}
  assert not names & {"task.length", "sampling.max_new_tokens", "update.is_method", "command"}
  # The library's StudyConfig of it: the same values, without the script's fields.
  study = gs.study_config(cfg.replace(lengths=(9,)))
  assert type(study) is StudyConfig and study.sampling.n == 4 and study.lengths == (9,)
  assert study.sft.optimizer.lr == 2e-3 and not hasattr(study.sft, "target")
  # Bad values name the flag.
  with pytest.raises(ConfigError, match="end_by_s: must be >= --start_by_s"):
    d.replace(end_by_s=300)
  with pytest.raises(ConfigError, match="sft.optimizer.schedule: 'cosine'"):
    d.replace(sft={"optimizer": {"schedule": "cosine"}})
  with pytest.raises(ConfigError, match="sft.budget_s: must be <= --start_by_s"):
    d.replace(sft={"budget_s": 500.0})
  with pytest.raises(ConfigError, match="length"):
    d.replace(length=301)  # addition's lengths are 1-300


def test_gpu_study_length_reaches_min_tokens(root):
  gs = _gpu_study(root)
  cfg = gs.GPUStudyConfig()
  length = gs.task_length(cfg, 1024)
  # Addition's longest gold completion + eos + the margin of 8, just reaching 1024 at `length`.
  assert max_new_tokens_for(cfg.replace(lengths=(length,)), length) >= 1024
  assert max_new_tokens_for(cfg.replace(lengths=(length - 1,)), length - 1) < 1024
  with pytest.raises(ConfigError, match="min_tokens: 100000: no length of addition"):
    gs.task_length(cfg, 100_000)


@pytest.fixture(scope="module")
def gpu_toy_study(tmp_path_factory, root):
  """experiments/gpu_study.py at the toy size, fp8_rollout and jet, seed 0: (out dir, result)."""
  gs = _gpu_study(root)
  out = tmp_path_factory.mktemp("gpu_study")
  cfg = _gpu_toy(root, out)
  return out, gs.run(cfg, "python3 experiments/gpu_study.py --config=gpu_study_toy.py")


@pytest.mark.slow
def test_gpu_study_toy_report_and_resume(gpu_toy_study, root):
  """experiments/gpu_study.py at the toy size: the warm start, the runs, the report, the
  verdicts and gpu_study.json; a rerun skips what is done. Shapes as the tiny fixtures'."""
  tmp_path, out = gpu_toy_study
  gs = _gpu_study(root)
  report = (tmp_path / "study" / "report.md").read_text()
  for name in (
    "accuracy.png",
    "mismatch.png",
    "mismatch_by_position.png",
    "final_accuracy.png",
    "paired_differences.png",
  ):
    assert (tmp_path / "study" / name).stat().st_size > 1000, name
  assert "--config=gpu_study_toy.py" in report
  assert ACCURACY_HEADER in report and MISMATCH_HEADER in report
  assert "## Length 1" in report and "central effect **not judged**" in report
  saved = json.loads((tmp_path / "gpu_study.json").read_text())
  assert saved["verdicts"]["1"]["valid"] == "not judged" and not saved["not_run"]
  assert not saved["cut_short"] and saved["config"]["end_by_s"] == 480
  assert saved["config"]["lengths"] == [1] and saved["config"]["sampling"]["temperature"] == 0.7
  assert saved["warm_start"]["steps"] == 4
  assert saved["device"]["platform"] == jax.devices()[0].platform  # "cpu" here, "gpu" on a GPU
  rows = {r["recipe"]: r for r in out["rows"]}
  assert set(rows) == {"fp8_rollout", "jet"}
  for r in rows.values():
    assert r["steps"] == 2 and r["eval_steps"] == [0, 2]
    assert len(r["eval_accuracy_bf16"]) == 2  # scored in bf16 as well as in its own precision
    assert r["seq_abs_sum_mean"] > 0 and 0 <= r["ratio_out_frac"] <= 1
  # The off-policy recipe's rollout/training mismatch is far above the unified flow's.
  assert rows["fp8_rollout"]["abs_diff_mean"] > 3 * rows["jet"]["abs_diff_mean"]
  log = (tmp_path / "gpu_study.log").read_text()
  assert "[2/2] L1/jet/seed0: running" in log and "mechanism" in log

  # Rerunning resumes: finished runs are skipped.
  cfg = _gpu_toy(root, tmp_path)
  gs.run(cfg)
  assert (tmp_path / "gpu_study.log").read_text().count("done already, skipped") == 2


@pytest.mark.slow
def test_gpu_study_stops_a_run_at_the_end_deadline(gpu_toy_study, root, tmp_path, monkeypatch):
  """A run still going at --end_by_s stops at its next step and is recorded as cut short; no run
  starts after it. The clock jumps past every deadline once the first run of seed 1 has written
  its first step's record."""
  import shutil
  import time

  gs = _gpu_study(root)
  shutil.copytree(gpu_toy_study[0], tmp_path, dirs_exist_ok=True)
  (tmp_path / "gpu_study.log").unlink()
  cut = tmp_path / "study" / "runs" / "L1" / "fp8_rollout" / "seed1"

  def clock():
    written = (cut / "metrics.jsonl").exists() and (cut / "metrics.jsonl").read_text().strip()
    return time.time() + (1e6 if written else 0.0)

  monkeypatch.setattr(gs, "clock", clock)
  cfg = _gpu_toy(root, tmp_path, seeds=(0, 1))
  out = gs.run(cfg)
  # Seed 0 was done; fp8_rollout/seed1 ran its step 1 of 2, then stopped; jet/seed1 never began.
  assert out["cut_short"] == [
    dict(run="L1/fp8_rollout/seed1", steps_done=1, steps=2, s=out["cut_short"][0]["s"])
  ]
  assert out["not_run"] == [
    "L1/fp8_rollout/seed1 (cut short after step 1 of 2 at --end_by_s)",
    "L1/jet/seed1",
  ]
  records = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1]
  assert not (cut / "summary.json").exists()  # not done: a rerun resumes it
  assert not (tmp_path / "study" / "runs" / "L1" / "jet" / "seed1").exists()
  assert sorted((r["recipe"], r["seed"]) for r in out["rows"]) == [("fp8_rollout", 0), ("jet", 0)]
  saved = json.loads((tmp_path / "gpu_study.json").read_text())
  assert saved["cut_short"] == out["cut_short"] and saved["not_run"] == out["not_run"]
  report = (tmp_path / "study" / "report.md").read_text()
  assert "L1/fp8_rollout/seed1 (cut short after step 1 of 2" in report
  log = (tmp_path / "gpu_study.log").read_text()
  assert "L1/fp8_rollout/seed1: cut short after step 1 of 2 at --end_by_s" in log
  assert "L1/jet/seed1: not started (past --start_by_s)" in log


def test_time_budget_stops_new_combinations(tmp_path, tiny_study_config):
  cfg = tiny_study_config(tmp_path, time_budget_s=0.0, recipes=("jet", "bf16"))
  out = run_study(cfg, log=quiet, quiet_runs=True)
  assert out["not_run"] == ["L1/jet/seed0", "L1/bf16/seed0"]
  assert "Time budget" in (tmp_path / "report.md").read_text()


def _python(*argv):
  """A Python subprocess (of this interpreter) on `argv`, its output captured."""
  return subprocess.run(
    [sys.executable, *map(str, argv)], check=False, capture_output=True, text=True, timeout=120
  )


def test_cli_rejects_unknown_recipe_and_lists_its_flags(tmp_path, root):
  res = _python(
    root / "experiments" / "compare_precisions.py", f"--report_dir={tmp_path}", "--recipes=jet,fp9"
  )
  assert res.returncode == 2 and "--recipes: 'fp9': unknown recipe" in res.stderr, res.stderr
  assert "Traceback" not in res.stderr
  # The study's flags: the RL nodes of train.py, the warm start's, none of the grid's fields.
  from jetrl.config.flags import flag_specs

  names = {s.path for s in flag_specs(StudyConfig(), exclude=set_by_study(StudyConfig()))}
  assert {
    "optimizer.lr",
    "sampling.temperature",
    "update.loss",
    "sft.optimizer.lr",
    "sft.steps",
    "sft.length",
    "sft.mix",
    "lengths",
    "recipes",
    "corrected",
    "correction",
  } <= names
  assert not names & {
    "task.length",
    "sampling.max_new_tokens",
    "update.is_method",
    "eval.also_bf16",
    "command",
    "recipe",
    "seed",
    "workdir",
    "init_from",
    "checkpoint.every",
    "sft.workdir",
    "sft.sampling.max_new_tokens",
    "sft.mix_lengths",
  }
  assert not {n for n in names if n.startswith(("sft.task.", "sft.model.", "sft.eval."))}


@pytest.mark.parametrize(
  "change, message",
  [
    (
      {"sampling.temperature": 0.0},
      r"--sampling.temperature: must be > 0 for RL sampling, got 0 \(the run L1/fp8_rollout/seed0\)",
    ),
    (
      {"sampling.n": 1},
      r"--sampling.n: must be >= 2 for group-relative advantages, got 1 \(the run ",
    ),
    ({"update.minibatches": 3}, r"--update.minibatches: prompts_per_step x sampling.n = 4 rows"),
    (
      {"update.overlong_buffer": 30},
      r"--update.overlong_buffer: must be < sampling.max_new_tokens",
    ),
  ],
)
def test_a_value_a_run_refuses_stops_the_study_before_any_warm_start(
  tmp_path, tiny_study_config, change, message
):
  """Values the study's own config accepts but its RL runs refuse: refused in seconds, before
  the warm start (minutes) would have trained, and before anything is written."""
  import time

  from jetrl.config import FlagError

  cfg = tiny_study_config(tmp_path / "study", **change)
  t0 = time.time()
  with pytest.raises(FlagError, match="^" + message):
    run_study(cfg, log=quiet)
  assert time.time() - t0 < 10
  assert not (tmp_path / "study").exists()


STUDY_FAILS = """
import runpy, sys
import jetrl.study
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.skips import SkippedUpdatesError
kind = sys.argv[1]
error = {"skipped": SkippedUpdatesError, "checkpoint": CheckpointError}[kind]
def run_study(cfg):
  raise error(f"the {kind} message")
jetrl.study.run_study = run_study
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_compare_precisions_exits_1_with_a_runs_error_and_2_with_a_runs_bad_flag(tmp_path, root):
  script = str(root / "experiments" / "compare_precisions.py")
  for kind in ("skipped", "checkpoint"):  # what a run of the study raises, as train.py maps it
    res = _python("-c", STUDY_FAILS, kind, script, f"--report_dir={tmp_path}")
    assert res.returncode == 1, res.stderr[-2000:]
    assert res.stderr.strip() == f"compare_precisions.py: error: the {kind} message"
  res = _python(script, f"--report_dir={tmp_path / 's'}", "--sampling.temperature=1e-30")
  assert res.returncode == 2, res.stderr[-2000:]
  assert res.stderr.strip().startswith(
    "compare_precisions.py: error: --sampling.temperature: must be 0 or in [0.01, 100], got 1e-30"
  )
  assert not (tmp_path / "s").exists()
