"""The precision-flow study: the same RL experiment under several precision recipes, rollout
lengths and seeds, each from a shared supervised warm start; then one report directory with
tables (report.md), per-combination results (results.json) and PNG plots.

  from jetrl.study import StudyConfig, run_study
  run_study(StudyConfig(report_dir="runs/study", lengths=(3, 8)))

`experiments/compare_precisions.py` is the command-line front end (one flag per field).
Modules: `config` (the templates of the runs and warm starts, the grid, each combination's
configs), `runner` (runs the grid, resumable), `summary` (per-run rows, results.json), `stats`
(aggregates over seeds, paired intervals, verdicts), `tables` (the markdown tables), `report`
(report.md), `plots` (figures); for the third round, `gradients` (the trainer's gradient and
how far another batch or arithmetic moves it; experiments/gradient_study.py), `power` (seeds
for a paired effect) and `prereg` (the pre-registered test's outcomes and rules).

Layout of the report directory:

  sft/L{length}/                     the warm start at that length (skipped if present); with
                                     --sft.length one, shared by every length
  sft/mix{lengths}/                  with --sft.mix, one trained on every length, shared by all
  runs/L{length}/{arm}/seed{s}/      one RL run (`jetrl.train.run`'s workdir)
  results.json                       one row per finished combination (the aggregates' source)
  verdicts.json                      the verdicts per length (rules: `stats`)
  report.md, *.png                   the report

An arm is a precision recipe and the importance-sampling correction of its runs (`Arm`): one
per recipe of `recipes`, and one more, with `correction`, for each recipe `corrected` lists. Its
label names its runs, rows and table lines: the recipe, followed by `+` and the correction when
there is one (`fp8_rollout+tis`).
"""

from jetrl.study.config import (
  Arm,
  CORRECTIONS,
  StudyConfig,
  WarmStartConfig,
  check_combinations,
  combinations,
  is_done,
  max_new_tokens_for,
  run_dir,
  run_settings,
  set_by_study,
  sft_config,
  sft_dir,
  sft_length,
  sft_name,
  sft_settings,
  tag,
  train_config,
)
from jetrl.study.summary import (
  collect,
  summarize_run,
)
from jetrl.study.stats import (
  aggregate,
  paired_interval,
  verdicts,
)
from jetrl.study.tables import (
  ACCURACY_HEADER,
  MISMATCH_HEADER,
  TABLE_HEADER,
  format_mismatch_table,
  format_table,
)
from jetrl.study.report import (
  write_report,
)
from jetrl.study.runner import (
  run_study,
)

__all__ = [
  "Arm",
  "CORRECTIONS",
  "StudyConfig",
  "WarmStartConfig",
  "check_combinations",
  "combinations",
  "is_done",
  "max_new_tokens_for",
  "run_dir",
  "run_settings",
  "set_by_study",
  "sft_config",
  "sft_dir",
  "sft_length",
  "sft_name",
  "sft_settings",
  "tag",
  "train_config",
  "collect",
  "summarize_run",
  "aggregate",
  "paired_interval",
  "verdicts",
  "ACCURACY_HEADER",
  "MISMATCH_HEADER",
  "TABLE_HEADER",
  "format_mismatch_table",
  "format_table",
  "write_report",
  "run_study",
]
