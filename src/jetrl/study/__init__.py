"""The precision-flow study: the same RL experiment under several precision recipes, rollout
lengths and seeds, each from a shared supervised warm start; then one report directory with
tables (report.md), per-combination results (results.json) and PNG plots.

  from jetrl.study import StudyConfig, run_study
  run_study(StudyConfig(report_dir="runs/study", lengths=(3, 8)))

`experiments/compare_precisions.py` is the command-line front end (one flag per field).
Modules: `config` (the grid and each combination's configs), `runner` (runs the grid,
resumable), `report` (aggregates, table, report.md), `plots` (figures).

Layout of the report directory:

  sft/L{length}/                     the warm start at that length (skipped if present); with
                                     --sft.length one, shared by every length
  sft/mix{lengths}/                  with --sft.mix, one trained on every length, shared by all
  runs/L{length}/{recipe}/seed{s}/   one RL run (`jetrl.train.run`'s workdir)
  results.json                       one row per finished combination (the aggregates' source)
  verdicts.json                      the verdicts per length (rules: `report`)
  report.md, *.png                   the report

A recipe spec is a recipe name, optionally followed by `+` and an importance-sampling
correction: `fp8_rollout+tis`.
"""

from jetrl.study.config import (
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
  sft_length,
  sft_name,
  train_config,
)
from jetrl.study.report import (
  ACCURACY_HEADER,
  MISMATCH_HEADER,
  TABLE_HEADER,
  aggregate,
  collect,
  format_mismatch_table,
  format_table,
  paired_interval,
  summarize_run,
  verdicts,
  write_report,
)
from jetrl.study.runner import run_study

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
  "sft_length",
  "sft_name",
  "train_config",
  "ACCURACY_HEADER",
  "MISMATCH_HEADER",
  "TABLE_HEADER",
  "aggregate",
  "collect",
  "format_mismatch_table",
  "format_table",
  "paired_interval",
  "summarize_run",
  "verdicts",
  "write_report",
  "run_study",
]
