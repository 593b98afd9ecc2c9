"""The study's aggregates and its report: per-run summaries from each run's metric records,
means over seeds, the markdown table and report.md (with the figures of
`jetrl.train.study.plots`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

from jetrl.train.study.config import (
  StudyConfig,
  combinations,
  is_done,
  max_new_tokens_for,
  run_dir,
  sft_dir,
)
from jetrl.train.study.plots import write_plots
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
  best = max(ev_acc) if ev_acc else float("nan")
  final = ev_acc[-1] if ev_acc else float("nan")
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
  t = lambda k: float(np.mean([r[k] for r in tail])) if tail else float("nan")
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
    eval_initial=ev_acc[0] if ev_acc else float("nan"),
    eval_final=final,
    eval_best=best,
    steps_to_target=hit[0] if hit else None,
    diverged=diverged,
    diverged_why=why,
    skipped_updates=skipped,
    abs_diff_mean=float(np.mean(col("agree/abs_diff_mean"))),
    abs_diff_max=float(np.max(col("agree/abs_diff_max"))),
    kl_k3=float(np.mean(col("agree/kl_k3"))),
    reward_last=float(np.mean([r["reward_mean"] for r in last])),
    train_acc_last=float(np.mean([r["accuracy"] for r in last])),
    response_length=float(np.mean(col("response_length"))),
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
  for L, spec, seed in combinations(cfg):
    if not is_done(cfg, L, spec, seed):
      continue
    row = dict(
      length=L,
      recipe=spec,
      seed=seed,
      max_new_tokens=max_new_tokens_for(cfg, L),
      wall_s=timing.get(f"L{L}/{spec}/seed{seed}"),
      **summarize_run(cfg, run_dir(cfg, L, spec, seed)),
    )
    rows.append(row)
  with open(os.path.join(cfg.report_dir, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return rows


def _mean_spread(xs) -> tuple[float, float]:
  xs = np.asarray([x for x in xs if x is not None], float)
  if not len(xs):
    return float("nan"), float("nan")
  return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def aggregate(rows: Sequence[dict]) -> list[dict]:
  """Rows grouped by (length, recipe) over seeds, in first-seen order."""
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["length"], r["recipe"]), []).append(r)
  out = []
  for (L, spec), rs in groups.items():
    acc, acc_sd = _mean_spread([r["eval_final"] for r in rs])
    init, _ = _mean_spread([r["eval_initial"] for r in rs])
    hits = [r["steps_to_target"] for r in rs]
    out.append(
      dict(
        length=L,
        recipe=spec,
        n_seeds=len(rs),
        max_new_tokens=rs[0]["max_new_tokens"],
        eval_initial=init,
        eval_final=acc,
        eval_final_sd=acc_sd,
        steps_to_target=[h for h in hits],
        n_diverged=sum(r["diverged"] for r in rs),
        diverged_why=sorted({w for r in rs for w in r["diverged_why"]}),
        abs_diff_mean=float(np.mean([r["abs_diff_mean"] for r in rs])),
        abs_diff_max=float(np.max([r["abs_diff_max"] for r in rs])),
        kl_k3=float(np.mean([r["kl_k3"] for r in rs])),
        reward_last=float(np.mean([r["reward_last"] for r in rs])),
        response_length=float(np.mean([r["response_length"] for r in rs])),
        time_rollout=float(np.mean([r["time_rollout"] for r in rs])),
        time_reward=float(np.mean([r["time_reward"] for r in rs])),
        time_update=float(np.mean([r["time_update"] for r in rs])),
        wall_s=float(np.mean([r["wall_s"] for r in rs if r.get("wall_s") is not None] or [np.nan])),
      )
    )
  return out


TABLE_HEADER = (
  "| recipe | seeds | greedy acc @0 | final greedy acc | steps to target | diverged | "
  "mean \\|Δlog p\\| | max \\|Δlog p\\| | ≈ Σ\\|Δlog p\\| per seq. | k3 KL | train reward (last 10) | "
  "resp. len | rollout s/step | update s/step | wall s/run |"
)


def _fmt(x, spec=".3f"):
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  return format(x, spec)


def format_table(agg_rows: Sequence[dict], target: float) -> str:
  lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
  for a in agg_rows:
    acc = _fmt(a["eval_final"]) + (f" ± {a['eval_final_sd']:.3f}" if a["n_seeds"] > 1 else "")
    hits = a["steps_to_target"]
    hit = ", ".join("never" if h is None else str(h) for h in hits)
    div = f"{a['n_diverged']}/{a['n_seeds']}" + (
      f" ({', '.join(a['diverged_why'])})" if a["diverged_why"] else ""
    )
    lines.append(
      f"| {a['recipe']} | {a['n_seeds']} | {_fmt(a['eval_initial'])} | {acc} | {hit} | {div} | "
      f"{_fmt(a['abs_diff_mean'], '.2e')} | {_fmt(a['abs_diff_max'], '.2e')} | "
      f"{_fmt(a['abs_diff_mean'] * a['response_length'], '.2e')} | "
      f"{_fmt(a['kl_k3'], '.2e')} | {_fmt(a['reward_last'])} | {_fmt(a['response_length'], '.1f')} | "
      f"{_fmt(a['time_rollout'], '.2f')} | {_fmt(a['time_update'], '.2f')} | "
      f"{_fmt(a['wall_s'], '.0f')} |"
    )
  return "\n".join(lines)


def write_report(
  cfg: StudyConfig,
  rows: Sequence[dict],
  timing: dict,
  *,
  not_run: Sequence[str] = (),
  budget_hit: bool = False,
  study_wall_s: float | None = None,
) -> str:
  """report.md (and the figures) of the finished rows; its path."""
  agg = aggregate(rows)
  plots = write_plots(cfg, rows, agg) if rows else []
  out = [
    "# Precision-flow study",
    "",
    "Produced by:",
    "",
    "```",
    cfg.command or "(run_study called from Python)",
    "```",
    "",
    f"Task `{cfg.task.name}` (difficulty {cfg.task.difficulty}), model `{cfg.model.name}`"
    + (f" with {cfg.model.n_layers} layers" if cfg.model.n_layers else "")
    + f"; RL: {cfg.steps} steps, {cfg.prompts_per_step} prompts x {cfg.sampling.n} samples,"
    f" loss {cfg.update.loss}, lr {cfg.optimizer.lr:g}, temperature "
    f"{cfg.sampling.temperature:g}, greedy eval on {cfg.eval.size} held-out problems "
    + (f"every {cfg.eval.every} steps" if cfg.eval.every else "at the start and the end")
    + f"; warm start: {cfg.sft.steps} {cfg.sft.recipe} SFT steps (batch "
    f"{cfg.sft.batch_size}, lr {cfg.sft.optimizer.lr:g}), one per "
    "length, shared by every recipe and seed of that length. Recipes: "
    + ", ".join(f"`{r}`" for r in cfg.recipes)
    + f"; seeds: {list(cfg.seeds)}.",
    "",
    (
      f"Columns: greedy accuracy on held-out problems at step 0 and at the end (mean ± sample "
      f"std over seeds); the first evaluated step with greedy accuracy ≥ {cfg.target_accuracy:g} "
      f"per seed; diverged = any non-finite metric, a skipped update, or a final greedy accuracy "
      f"below {cfg.collapse_ratio:g} x the run's best; |Δlog p| = |rollout log-prob − training "
      "forward log-prob| of the sampled tokens (mean over steps of the per-step mean; max over "
      "all tokens of the run; Σ per sequence = mean × mean response length, the size of a "
      "sequence-level log importance ratio); k3 KL between the rollout and training policies (mean over steps); "
      "time per step excludes the first (compiling) step."
    ),
    "",
  ]
  if budget_hit or not_run:
    out += [
      f"**Time budget ({cfg.time_budget_s or 0:.0f} s) exceeded: {len(not_run)} "
      f"combination(s) not run:** " + ", ".join(not_run),
      "",
    ]
  for L in cfg.lengths:
    sub = [a for a in agg if a["length"] == int(L)]
    sft_acc = None
    p = os.path.join(sft_dir(cfg, L), "sft_summary.json")
    if os.path.exists(p):
      with open(p) as f:
        sft_acc = json.load(f).get("eval_accuracy")
    out += [
      f"## Length {L} (max_new_tokens {max_new_tokens_for(cfg, L)})",
      "",
      f"Warm start greedy accuracy (bf16 rollout): {_fmt(sft_acc)}"
      + (f"; SFT time {timing[f'sft/L{L}']:.0f} s" if f"sft/L{L}" in timing else ""),
      "",
    ]
    out += [format_table(sub, cfg.target_accuracy) if sub else "(no finished runs)", ""]
  if study_wall_s is not None:
    total = sum(timing.values())
    out += [
      (
        f"Wall time of this invocation: {study_wall_s:.0f} s; recorded wall time of all "
        f"runs and warm starts: {total:.0f} s."
      ),
      "",
    ]
  if plots:
    out += ["## Figures", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    out.append("")
  path = os.path.join(cfg.report_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(out))
  return path
