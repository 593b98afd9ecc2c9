"""The precision-flow study at a toy size: report structure, resume, mismatch ordering, flags."""

import json
import subprocess
import sys

import pytest

from conftest import quiet
from jetrl.config import ConfigError
from jetrl.train.study import (
  TABLE_HEADER,
  StudyConfig,
  max_new_tokens_for,
  parse_recipe,
  run_study,
  train_config,
)


def test_parse_recipe_budget_and_combination_configs(tiny_study_config):
  assert parse_recipe("jet") == ("jet", "none")
  assert parse_recipe("fp8_rollout+tis") == ("fp8_rollout", "tis")
  with pytest.raises(ConfigError, match="unknown recipe"):
    parse_recipe("fp9")
  with pytest.raises(ConfigError, match="unknown correction"):
    parse_recipe("jet+foo")
  cfg = tiny_study_config("x")
  assert max_new_tokens_for(cfg, 1) == 21 + 1 + 2  # longest gold completion + eos + margin
  run_cfg = train_config(cfg.replace(recipes=("fp8_rollout+tis",)), 1, "fp8_rollout+tis", 3)
  assert (run_cfg.recipe, run_cfg.update.is_method, run_cfg.seed) == ("fp8_rollout", "tis", 3)
  assert (run_cfg.task.length, run_cfg.sampling.max_new_tokens) == (1, 24)
  assert run_cfg.optimizer is cfg.optimizer and run_cfg.init_from.endswith("sft/L1")
  with pytest.raises(ConfigError, match=r"lengths: 0: must be in \[1, 300\]"):
    cfg.replace(lengths=(0,))
  with pytest.raises(ConfigError, match="task.name: 'gsm8k' is not a synthetic task"):
    cfg.replace(task={"name": "gsm8k"})


@pytest.mark.slow
def test_toy_study_report(tmp_path, tiny_study_config):
  cmd = "python experiments/compare_precisions.py --report_dir=toy"
  cfg = tiny_study_config(tmp_path, command=cmd)
  lines = []
  out = run_study(cfg, log=lines.append, quiet_runs=True)
  report = (tmp_path / "report.md").read_text()
  assert out["report"] == str(tmp_path / "report.md") and not out["not_run"]
  for name in ("accuracy.png", "mismatch.png", "mismatch_by_position.png", "final_accuracy.png"):
    assert (tmp_path / name).stat().st_size > 1000, name
  assert (tmp_path / "sft" / "L1" / "sft_summary.json").exists()
  assert cmd in report and TABLE_HEADER in report and "## Length 1" in report
  assert "| fp8_rollout |" in report and "| jet |" in report
  rows = {r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())}
  assert set(rows) == {"fp8_rollout", "jet"}
  for r in rows.values():
    assert r["steps"] == 2 and r["eval_steps"] == [0, 2]
  # The off-policy recipe's rollout/training mismatch is far above the unified flow's.
  assert rows["fp8_rollout"]["abs_diff_mean"] > 3 * rows["jet"]["abs_diff_mean"]
  assert any("[2/2] L1/jet/seed0: running" in s for s in lines)

  # Rerunning resumes: finished combinations are skipped and the warm start is reused.
  lines2 = []
  run_study(cfg, log=lines2.append, quiet_runs=True)
  assert sum("done already, skipped" in s for s in lines2) == 2
  assert not any("warm start" in s for s in lines2)


def test_time_budget_stops_new_combinations(tmp_path, tiny_study_config):
  cfg = tiny_study_config(tmp_path, time_budget_s=0.0, recipes=("jet", "bf16"))
  out = run_study(cfg, log=quiet, quiet_runs=True)
  assert out["not_run"] == ["L1/jet/seed0", "L1/bf16/seed0"]
  assert "Time budget" in (tmp_path / "report.md").read_text()


def test_cli_rejects_unknown_recipe_and_lists_its_flags(tmp_path, root):
  res = subprocess.run(
    [
      sys.executable,
      str(root / "experiments" / "compare_precisions.py"),
      f"--report_dir={tmp_path}",
      "--recipes=jet,fp9",
    ],
    check=False,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert res.returncode == 2 and "--recipes: 'fp9': unknown recipe" in res.stderr, res.stderr
  assert "Traceback" not in res.stderr
  # The study's flags: the RL nodes of train.py, the warm start's, none of the grid's fields.
  from jetrl.config.flags import flag_specs
  from jetrl.train.study import GRID_FIELDS

  names = {s.path for s in flag_specs(StudyConfig(), exclude=GRID_FIELDS)}
  assert {
    "optimizer.lr",
    "sampling.temperature",
    "update.loss",
    "sft.optimizer.lr",
    "sft.steps",
    "lengths",
    "recipes",
  } <= names
  assert not names & {"task.length", "sampling.max_new_tokens", "update.is_method", "command"}
