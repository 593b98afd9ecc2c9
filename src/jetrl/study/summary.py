"""Per-run summaries of the study: aggregates of each finished run's metric records
(metrics.jsonl, eval.jsonl), one row per combination in results.json."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from jetrl.study.config import StudyConfig, combinations, is_done, max_new_tokens_for, run_dir, tag
from jetrl.study.stats import nan_mean
from jetrl.train.writers import read_jsonl


def _finite_all(recs: Sequence[dict]) -> bool:
  for r in recs:
    for v in r.values():
      try:
        a = np.asarray(v, float)
      except (TypeError, ValueError):
        continue
      if not np.all(np.isfinite(a)):
        return False
  return True


def summarize_run(cfg: StudyConfig, workdir: str) -> dict:
  """Per-run aggregates from a finished RL workdir's metrics.jsonl and eval.jsonl."""
  recs = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
  col = lambda k: np.asarray([r[k] for r in recs if k in r], float)
  ev_steps = [int(e["step"]) for e in evals]
  ev_acc = [float(e["eval_accuracy"]) for e in evals]
  ev_bf16 = [float(e["eval_accuracy_bf16"]) for e in evals if "eval_accuracy_bf16" in e]
  if len(ev_bf16) != len(ev_acc):
    ev_bf16 = []
  nan = float("nan")
  best = max(ev_acc) if ev_acc else nan
  final = ev_acc[-1] if ev_acc else nan
  hit = [s for s, a in zip(ev_steps, ev_acc) if a >= cfg.target_accuracy]
  skipped = float(np.nansum(col("skipped_updates"))) if len(col("skipped_updates")) else 0.0
  finite = _finite_all(recs)
  collapsed = bool(best >= 0.1 and final < cfg.collapse_ratio * best)
  diverged = (not finite) or skipped > 0 or collapsed
  why = [
    w
    for w, c in (
      ("non-finite", not finite),
      (f"{int(skipped)} skipped", skipped > 0),
      ("collapsed", collapsed),
    )
    if c
  ]
  # Time per step, leaving out the steps that compiled (each process's first).
  if any("time/compiled" in r for r in recs):
    tail = [r for r in recs if not r.get("time/compiled")] or recs
  else:  # records written before the marker existed: the first step compiled
    tail = recs[1:] if len(recs) > 1 else recs
  t = lambda k: float(np.mean([r[k] for r in tail])) if tail else nan
  # Position profile: token-weighted mean over the run.
  prof, edges = None, None
  bins = [r for r in recs if "agree/bin_abs_diff_mean" in r]
  if bins:
    means = np.asarray([r["agree/bin_abs_diff_mean"] for r in bins], float)
    counts = np.asarray([r["agree/bin_count"] for r in bins], float)
    prof = ((means * counts).sum(0) / np.maximum(counts.sum(0), 1)).tolist()
    edges = list(bins[-1].get("agree/bin_edges") or range(len(prof)))
    keep = counts.sum(0) > 0
    prof = [p if k else None for p, k in zip(prof, keep)]
  last = recs[-10:]
  return dict(
    steps=len(recs),
    eval_steps=ev_steps,
    eval_accuracy=ev_acc,
    eval_accuracy_bf16=ev_bf16,
    eval_initial=ev_acc[0] if ev_acc else nan,
    eval_final=final,
    eval_initial_bf16=ev_bf16[0] if ev_bf16 else nan,
    eval_final_bf16=ev_bf16[-1] if ev_bf16 else nan,
    eval_best=best,
    steps_to_target=hit[0] if hit else None,
    diverged=diverged,
    diverged_why=why,
    skipped_updates=skipped,
    abs_diff_mean=nan_mean(col("agree/abs_diff_mean")),
    abs_diff_max=float(np.max(col("agree/abs_diff_max"))) if len(recs) else nan,
    seq_abs_sum_mean=nan_mean(col("agree/seq_abs_sum_mean")),
    seq_abs_sum_max=float(np.max(col("agree/seq_abs_sum_max")))
    if len(col("agree/seq_abs_sum_max"))
    else nan,
    kl_k3=nan_mean(col("agree/kl_k3")),
    ratio_out_frac=nan_mean(col("agree/ratio_out_frac")),
    reward_last=float(np.mean([r["reward_mean"] for r in last])),
    train_acc_last=float(np.mean([r["accuracy"] for r in last])),
    response_length=nan_mean(col("response_length")),
    time_rollout=t("time/rollout"),
    time_reward=t("time/reward"),
    time_update=t("time/update"),
    step_series=[int(r["step"]) for r in recs],
    reward_series=[float(r["reward_mean"]) for r in recs],
    acc_series=[float(r["accuracy"]) for r in recs],
    abs_diff_series=[float(r["agree/abs_diff_mean"]) for r in recs],
    kl_series=[float(r["agree/kl_k3"]) for r in recs],
    position_profile=prof,
    position_edges=edges,
  )


def collect(cfg: StudyConfig, timing: dict) -> list[dict]:
  """One row per finished combination (`timing`: wall seconds by combination); also written to
  results.json."""
  rows = []
  for L, arm, seed in combinations(cfg):
    if not is_done(cfg, L, arm, seed):
      continue
    row = dict(
      length=L,
      recipe=arm.label,
      seed=seed,
      max_new_tokens=max_new_tokens_for(cfg, L),
      wall_s=timing.get(tag(L, arm, seed)),
      **summarize_run(cfg, run_dir(cfg, L, arm, seed)),
    )
    rows.append(row)
  with open(os.path.join(cfg.report_dir, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return rows
