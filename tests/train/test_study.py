"""The precision-flow study at a toy size: report structure, resume, and mismatch ordering."""

import json
import os
import subprocess
import sys

import pytest

from jetrl.train.study import (
  TABLE_HEADER,
  StudyConfig,
  max_new_tokens_for,
  parse_recipe,
  run_study,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = dict(recipes=("fp8_rollout", "jet"), lengths=(1,), seeds=(0,), task="addition",
           difficulty=1, n_layers=1, token_margin=2, steps=3, prompts_per_step=2, group_size=2,
           eval_every=0, eval_size=4, sft_steps=20, sft_batch_size=16, sft_lr=3e-3)


def test_parse_recipe_and_budget():
  assert parse_recipe("jet") == ("jet", "none")
  assert parse_recipe("fp8_rollout+tis") == ("fp8_rollout", "tis")
  with pytest.raises(ValueError, match="unknown recipe"):
    parse_recipe("fp9")
  with pytest.raises(ValueError, match="unknown correction"):
    parse_recipe("jet+foo")
  cfg = StudyConfig(report_dir="x", **TOY)
  assert max_new_tokens_for(cfg, 1) == 21 + 1 + 2  # longest gold completion + eos + margin


@pytest.mark.slow
def test_toy_study_report(tmp_path):
  cmd = "python experiments/compare_precisions.py --report_dir=toy"
  cfg = StudyConfig(report_dir=str(tmp_path), command=cmd, **TOY)
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
    assert r["steps"] == 3 and r["eval_steps"] == [0, 3]
  # The off-policy recipe's rollout/training mismatch is far above the unified flow's.
  assert rows["fp8_rollout"]["abs_diff_mean"] > 3 * rows["jet"]["abs_diff_mean"]
  assert any("[2/2] L1/jet/seed0: running" in s for s in lines)

  # Rerunning resumes: finished combinations are skipped and the warm start is reused.
  lines2 = []
  run_study(cfg, log=lines2.append, quiet_runs=True)
  assert sum("done already, skipped" in s for s in lines2) == 2
  assert not any("warm start" in s for s in lines2)


@pytest.mark.slow
def test_time_budget_stops_new_combinations(tmp_path):
  cfg = StudyConfig(report_dir=str(tmp_path), time_budget_s=1e-9,
                    **dict(TOY, recipes=("jet", "bf16")))
  out = run_study(cfg, log=lambda *a: None, quiet_runs=True)
  assert out["not_run"] == ["L1/jet/seed0", "L1/bf16/seed0"]
  assert "Time budget" in (tmp_path / "report.md").read_text()


def test_cli_rejects_unknown_recipe(tmp_path):
  res = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "compare_precisions.py"),
                        f"--report_dir={tmp_path}", "--recipes=jet,fp9"],
                       check=False, capture_output=True, text=True, timeout=120)
  assert res.returncode != 0 and "unknown recipe" in res.stderr
