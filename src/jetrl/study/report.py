"""The study's report: report.md (the setup, per length the warm start, the tables and the
verdicts, the figures of `jetrl.study.plots`) and verdicts.json. The aggregates and the rules
are `jetrl.study.stats`'s, the tables `jetrl.study.tables`'."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from jetrl.study.config import (
  StudyConfig,
  max_new_tokens_for,
  sft_dir,
  sft_length,
  sft_lengths_text,
  sft_name,
)
from jetrl.study.plots import write_plots
from jetrl.study.stats import aggregate, verdicts
from jetrl.study.tables import fmt, format_mismatch_table, format_table


def write_report(
  cfg: StudyConfig,
  rows: Sequence[dict],
  timing: dict,
  *,
  not_run: Sequence[str] = (),
  budget_hit: bool = False,
  study_wall_s: float | None = None,
) -> str:
  """report.md (and the figures, and verdicts.json) of the finished rows; its path."""
  agg = aggregate(rows)
  plots = write_plots(cfg, rows, agg) if rows else []
  shared = cfg.sft.length is not None or cfg.sft.mix
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
    f" loss {cfg.update.loss}, old log-probs: {cfg.update.old_logp}, lr {cfg.optimizer.lr:g}, "
    f"temperature {cfg.sampling.temperature:g}; evaluation: {cfg.eval.label} on {cfg.eval.size} "
    "held-out problems "
    + (f"every {cfg.eval.every} steps" if cfg.eval.every else "at the start and the end")
    + ", scored in each recipe's own rollout precision and in bf16"
    + f"; warm start: {cfg.sft.steps} {cfg.sft.recipe} SFT steps (batch "
    f"{cfg.sft.batch_size}, lr {cfg.sft.optimizer.lr:g}), "
    + (
      f"one on {sft_lengths_text(cfg, cfg.lengths[0])}, shared by every length, recipe and seed"
      if shared
      else "one per length, shared by every recipe and seed of that length"
    )
    + ". Recipes: "
    + ", ".join(f"`{arm.label}`" for arm in cfg.arms)
    + f"; seeds: {list(cfg.seeds)}.",
    "",
    (
      f"Accuracy columns: {cfg.eval.label} on held-out problems at step 0 and at the end "
      "(mean ± sample std over seeds), in the recipe's own rollout precision and scored with "
      "the bf16 rollout; gain = final − initial (bf16-scored); − bf16 = the paired difference "
      "from bf16 over the same seeds, with its 95% Student t interval and p-value; diverged = "
      f"a non-finite metric, a skipped update, or a final accuracy below {cfg.collapse_ratio:g} "
      "x the run's best. Mismatch columns (Δ = training-forward log p − rollout log p of each "
      "sampled token, before the update): mean |Δ| and mean |ΣΔ| per sequence (the sequence "
      "log importance ratio) are means over steps, the maxima over the run; k3 KL(rollout ‖ "
      "train); the fraction of tokens whose ratio exp(Δ) leaves [0.8, 1.2]; time per step "
      "excludes the first (compiling) step."
    ),
    "",
  ]
  if budget_hit or not_run:
    out += [
      f"**Time budget ({cfg.time_budget_s or 0:.0f} s) exceeded: {len(not_run)} "
      f"combination(s) not run:** " + ", ".join(not_run),
      "",
    ]
  all_verdicts = {}
  for L in cfg.lengths:
    L = int(L)
    sub = [a for a in agg if a["length"] == L]
    sft_acc = None
    p = os.path.join(sft_dir(cfg, L), "sft_summary.json")
    if os.path.exists(p):
      with open(p) as f:
        sft_acc = json.load(f).get("eval_accuracy")
    key = f"sft/{sft_name(cfg, L)}"
    out += [
      f"## Length {L} (max_new_tokens {max_new_tokens_for(cfg, L)})",
      "",
      f"Warm start ({sft_lengths_text(cfg, L)}; evaluated at length {sft_length(cfg, L)}) "
      f"{cfg.eval.label} (bf16 rollout): "
      f"{fmt(sft_acc)}" + (f"; SFT time {timing[key]:.0f} s" if key in timing else ""),
      "",
    ]
    if not sub:
      out += ["(no finished runs)", ""]
      continue
    v = verdicts(rows, agg, L)
    all_verdicts[L] = v
    out += [format_table(sub), "", format_mismatch_table(sub), ""]
    out += (
      [
        f"Verdicts: **{v['valid']}**; mechanism **{v['mechanism']}**; central effect "
        f"**{v['central']}**.",
        "",
      ]
      + [f"- {k}: {w}" for k, w in v["why"].items()]
      + [""]
    )
  with open(os.path.join(cfg.report_dir, "verdicts.json"), "w") as f:
    json.dump({str(k): v for k, v in all_verdicts.items()}, f, indent=1)
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
