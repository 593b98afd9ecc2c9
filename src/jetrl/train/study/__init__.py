"""The precision-flow study: the same RL experiment under several precision recipes, rollout
lengths and seeds, each from a shared supervised warm start; then one report directory with
tables (report.md), per-combination results (results.json) and PNG plots.

  from jetrl.train.study import StudyConfig, run_study
  run_study(StudyConfig(report_dir="runs/study", lengths=(3, 8)))

`experiments/compare_precisions.py` is the command-line front end (one flag per field).
Modules: `config` (the grid and each combination's configs), `runner` (runs the grid,
resumable), `report` (aggregates, table, report.md), `plots` (figures).

Layout of the report directory:

  sft/L{length}/                     the warm start of that length (skipped if present)
  runs/L{length}/{recipe}/seed{s}/   one RL run (`jetrl.train.run`'s workdir)
  results.json                       one row per finished combination (the aggregates' source)
  report.md, *.png                   the report

A recipe spec is a recipe name, optionally followed by `+` and an importance-sampling
correction: `fp8_rollout+tis`.
"""

from jetrl.train.study.config import (
  DEFAULT_RECIPES,
  GRID_FIELDS,
  StudyConfig,
  WarmStartConfig,
  combinations,
  is_done,
  max_new_tokens_for,
  parse_recipe,
  run_dir,
  sft_config,
  sft_dir,
  train_config,
)
from jetrl.train.study.report import (
  TABLE_HEADER,
  aggregate,
  collect,
  format_table,
  summarize_run,
  write_report,
)
from jetrl.train.study.runner import run_study

__all__ = [
  "DEFAULT_RECIPES",
  "GRID_FIELDS",
  "StudyConfig",
  "WarmStartConfig",
  "combinations",
  "is_done",
  "max_new_tokens_for",
  "parse_recipe",
  "run_dir",
  "sft_config",
  "sft_dir",
  "train_config",
  "TABLE_HEADER",
  "aggregate",
  "collect",
  "format_table",
  "summarize_run",
  "write_report",
  "run_study",
]
