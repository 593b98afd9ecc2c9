"""Running the study's grid: one warm start per length, then every (length, recipe, seed).

A combination whose workdir holds `summary.json` is done and is not run again; an unfinished
one resumes from its own checkpoints (`jetrl.train.run` does that); a warm start whose
`sft_summary.json` exists is reused. The wall time of every run and warm start is recorded in
`<report_dir>/timing.json`, so the report of a study resumed over several invocations still
shows it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Optional

from jetrl.config import FlagError
from jetrl.study.config import (
  StudyConfig,
  check_combinations,
  combinations,
  is_done,
  sft_config,
  sft_dir,
  sft_name,
  tag,
  train_config,
)
from jetrl.study.report import write_report
from jetrl.study.summary import collect
from jetrl.train.loop import run
from jetrl.train.sft import run_sft
from jetrl.train.validation import check_local


def timing_path(cfg: StudyConfig) -> str:
  return os.path.join(cfg.report_dir, "timing.json")


def read_timing(cfg: StudyConfig) -> dict:
  path = timing_path(cfg)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def _write_timing(cfg: StudyConfig, timing: dict) -> None:
  with open(timing_path(cfg), "w") as f:
    json.dump(timing, f, indent=1)


def run_study(
  cfg: StudyConfig, *, log: Callable = print, quiet_runs: Optional[bool] = None
) -> dict:
  """Run every (length, recipe, seed) not done yet, one after another, then write the report.

  Every warm start's and run's config is built first, so that a value a run refuses is a
  FlagError before anything trains. Stops starting new combinations (warm starts included) once `time_budget_s` is exceeded; the
  report then lists what was not run. `quiet_runs` (default: the config's) hides the runs' own
  lines. Returns {"report": path, "rows": [...], "not_run": [...]}.
  """
  if not cfg.report_dir:
    raise FlagError("report_dir", "is required (where the runs and the report go)")
  check_local("report_dir", cfg.report_dir)
  check_combinations(cfg)  # every run's config, before any warm start trains
  quiet = cfg.quiet_runs if quiet_runs is None else quiet_runs
  os.makedirs(cfg.report_dir, exist_ok=True)
  with open(os.path.join(cfg.report_dir, "study_config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
  sub_log = (lambda *a, **k: None) if quiet else log
  t_start = time.time()
  combos = combinations(cfg)
  not_run, budget_hit = [], False
  timing = read_timing(cfg)

  def over_budget():
    return cfg.time_budget_s is not None and time.time() - t_start > cfg.time_budget_s

  for i, (length, arm, seed) in enumerate(combos):
    name = tag(length, arm, seed)
    head = f"[{i + 1}/{len(combos)}] {name}"
    if is_done(cfg, length, arm, seed):
      log(f"{head}: done already, skipped")
      continue
    if over_budget():
      budget_hit = True
      not_run.append(name)
      log(f"{head}: not started (time budget {cfg.time_budget_s:.0f}s exceeded)")
      continue
    if not os.path.exists(os.path.join(sft_dir(cfg, length), "sft_summary.json")):
      log(f"warm start for length {length}: {cfg.sft.steps} SFT steps -> {sft_dir(cfg, length)}")
      t0 = time.time()
      res = run_sft(sft_config(cfg, length), log=sub_log)
      timing[f"sft/{sft_name(cfg, length)}"] = time.time() - t0
      _write_timing(cfg, timing)
      log(
        f"warm start for length {length}: {cfg.eval.label} {res['eval_accuracy']:.3f} "
        f"({time.time() - t0:.0f}s)"
      )
    log(f"{head}: running (study elapsed {time.time() - t_start:.0f}s)")
    t0 = time.time()
    summary = run(train_config(cfg, length, arm, seed), log=sub_log)
    timing[name] = timing.get(name, 0.0) + time.time() - t0
    _write_timing(cfg, timing)
    log(
      f"{head}: {cfg.eval.label} {summary['eval_before']:.3f} -> "
      f"{summary['eval_after']:.3f}, skipped updates {summary['skipped_updates']} "
      f"({time.time() - t0:.0f}s)"
    )
  rows = collect(cfg, timing)
  path = write_report(
    cfg, rows, timing, not_run=not_run, budget_hit=budget_hit, study_wall_s=time.time() - t_start
  )
  log(f"report: {path}")
  return {"report": path, "rows": rows, "not_run": not_run}
