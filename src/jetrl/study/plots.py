"""The study's figures: accuracy and reward against step, the mismatch |Δ log p| against step
and by token position, final accuracy by length, paired differences from bf16 with their 95%
intervals. One colour per recipe; axes labelled; the
legend right of the panels; a log axis only where the values span orders of magnitude
(`jetrl.train.plots`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from jetrl.train.plots import bin_labels, off_screen, use_log_scale


def _smooth(y, k=5):
  y = np.asarray(y, float)
  if len(y) < k:
    return y
  c = np.convolve(y, np.ones(k) / k, mode="valid")
  return np.concatenate([np.full(k - 1, np.nan), c])


def _seed_mean(rs, key, xkey):
  n = min(len(r[key]) for r in rs)
  return np.asarray(rs[0][xkey][:n]), np.mean([r[key][:n] for r in rs], axis=0)


def write_plots(cfg, rows: Sequence[dict], agg: Sequence[dict]) -> list[str]:
  plt = off_screen()
  all_labels = [arm.label for arm in cfg.arms]
  labels = [r for r in all_labels if any(x["recipe"] == r for x in rows)]
  colors = {r: plt.cm.tab10(i % 10) for i, r in enumerate(all_labels)}
  lengths = [int(L) for L in cfg.lengths if any(x["length"] == int(L) for x in rows)]
  of = lambda L, label: [r for r in rows if r["length"] == L and r["recipe"] == label]
  paths = []

  def save(fig, axes, name):
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    if handles:
      fig.legend(
        handles,
        legend_labels,
        loc="upper left",
        bbox_to_anchor=(1.0, 0.95),
        fontsize=8,
        title="recipe",
        title_fontsize=8,
      )
    p = os.path.join(cfg.report_dir, name)
    fig.tight_layout()
    fig.savefig(p, dpi=72, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)

  fig, axes = plt.subplots(len(lengths), 2, figsize=(9, 2.8 * len(lengths)), squeeze=False)
  for i, L in enumerate(lengths):
    for label in labels:
      rs = of(L, label)
      if not rs:
        continue
      x, y = _seed_mean(rs, "reward_series", "step_series")
      axes[i, 0].plot(x, _smooth(y), color=colors[label], label=label)
      x, y = _seed_mean(rs, "eval_accuracy", "eval_steps")
      axes[i, 1].plot(x, y, "o-", color=colors[label], label=label)
      if all(r.get("eval_accuracy_bf16") for r in rs):
        x, y = _seed_mean(rs, "eval_accuracy_bf16", "eval_steps")
        axes[i, 1].plot(x, y, "x--", color=colors[label], alpha=0.7)
    axes[i, 0].set_title(f"length {L}: train reward (5-step mean)", fontsize=9)
    axes[i, 0].set_ylabel("reward")
    axes[i, 1].set_title(f"length {L}: held-out accuracy (o own, x bf16-scored)", fontsize=9)
    axes[i, 1].set_ylabel("accuracy")
    for ax in axes[i]:
      ax.set_xlabel("RL step"), ax.set_ylim(-0.02, 1.02), ax.grid(alpha=0.3)
  save(fig, axes, "accuracy.png")

  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.2), squeeze=False)
  for i, L in enumerate(lengths):
    ax, drawn = axes[0, i], []
    for label in labels:
      rs = of(L, label)
      if rs:
        x, y = _seed_mean(rs, "abs_diff_series", "step_series")
        ax.plot(x, np.maximum(y, 1e-12), color=colors[label], label=label)
        drawn += list(y)
    if use_log_scale(drawn):
      ax.set_yscale("log")
    ax.set_title(f"length {L}: mean |Δlog p| per step", fontsize=9)
    ax.set_xlabel("RL step"), ax.set_ylabel("mean |Δ log p|"), ax.grid(alpha=0.3)
  save(fig, axes, "mismatch.png")

  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.2), squeeze=False)
  for i, L in enumerate(lengths):
    ax, drawn = axes[0, i], []
    for label in labels:
      rs = [r for r in of(L, label) if r["position_profile"] is not None]
      if not rs:
        continue
      prof = np.asarray([[np.nan if v is None else v for v in r["position_profile"]] for r in rs])
      y = np.nanmean(prof, axis=0)
      keep = np.isfinite(y)
      ax.plot(
        np.arange(len(y))[keep], np.maximum(y[keep], 1e-12), "o-", color=colors[label], label=label
      )
      ax.set_xticks(range(len(y)), bin_labels(rs[0]["position_edges"])[: len(y)])
      drawn += list(y[keep])
    if use_log_scale(drawn):
      ax.set_yscale("log")
    ax.set_xlabel("token position in the completion"), ax.set_ylabel("mean |Δ log p|")
    ax.set_title(f"length {L}: mean |Δlog p| by position", fontsize=9), ax.grid(alpha=0.3)
  save(fig, axes, "mismatch_by_position.png")

  fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(lengths), 3.2))
  w = 0.8 / max(len(labels), 1)
  for j, label in enumerate(labels):
    xs, ys, es = [], [], []
    for i, L in enumerate(lengths):
      a = [a for a in agg if a["length"] == L and a["recipe"] == label]
      if a:
        xs.append(i + (j - (len(labels) - 1) / 2) * w)
        key = (
          "eval_final_bf16" if a[0]["eval_final_bf16"] == a[0]["eval_final_bf16"] else "eval_final"
        )
        ys.append(a[0][key]), es.append(a[0][key + "_sd"])
    ax.bar(xs, ys, w, yerr=es, color=colors[label], label=label, capsize=2)
  ax.set_xticks(range(len(lengths)), [f"length {L}" for L in lengths])
  ax.set_xlabel("task length knob"), ax.set_ylabel("final accuracy (bf16-scored)")
  ax.set_ylim(0, 1.05), ax.grid(alpha=0.3, axis="y")
  save(fig, np.asarray([[ax]]), "final_accuracy.png")

  others = [r for r in labels if r != "bf16"]
  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.2), squeeze=False)
  for i, L in enumerate(lengths):
    ax = axes[0, i]
    for j, label in enumerate(others):
      a = [a for a in agg if a["length"] == L and a["recipe"] == label]
      if not a:
        continue
      for k, (key, marker, name) in enumerate(
        (("vs_bf16", "o", "bf16-scored"), ("vs_bf16_own", "s", "own precision"))
      ):
        c = a[0][key]
        if c["n"] < 2:
          continue
        ax.errorbar(
          j + (k - 0.5) * 0.25,
          c["mean"],
          yerr=[[c["mean"] - c["lo"]], [c["hi"] - c["mean"]]],
          fmt=marker,
          color=colors[label],
          mfc=colors[label] if k == 0 else "white",
          capsize=3,
          label=label if k == 0 else None,
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(others)), others, fontsize=8)
    ax.set_ylabel("final accuracy − bf16's (paired)")
    ax.set_title(f"length {L}: mean and 95% CI (filled: bf16-scored)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
  save(fig, axes, "paired_differences.png")
  return paths


def gradient_figure(results: Sequence[dict], path: str) -> str:
  """experiments/gradient_study.py's figure: per recipe against the generated budget, the
  cosine of its gradient to the gradient on the training forward's own rows (with the
  trainer's split-half cosine, the noise of one batch, dashed), its rows' sequence ESS; per
  training precision, the relative difference of its gradient to float32's on the same rows
  and the fraction of tokens clipped at the first step. Error bars: sd over the batches."""
  plt = off_screen()
  budgets = [r["max_new_tokens"] for r in results]
  names = list(results[0]["recipes"])
  trainers = list(results[0]["trainers"])
  colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))

  def line(ax, group, name, key, **kw):
    m = [r[group][name][key]["mean"] for r in results]
    s = [r[group][name][key]["sd"] for r in results]
    ax.errorbar(budgets, m, yerr=s, marker="o", capsize=3, color=colors.get(name), **kw)

  for n in names:
    line(axes[0], "recipes", n, "vs_own_cosine", label=n)
    line(axes[1], "recipes", n, "sequence_ess", label=n)
  for t in trainers:
    line(
      axes[0],
      "trainers",
      t,
      "split_half_cosine",
      ls="--",
      alpha=0.6,
      label=f"split half, {t} trainer",
    )
    line(axes[2], "trainers", t, "vs_fp32_rel_diff", label=f"{t} trainer")
    line(axes[3], "trainers", t, "clipped", label=f"{t} trainer")
  titles = (
    ("cosine to the gradient on the trainer's own rows", "cosine"),
    ("sequence importance weights: ESS / n", "ESS / n"),
    ("|g - g_fp32| / |g_fp32|, same rows", "relative difference"),
    ("tokens clipped at the first step", "fraction of tokens"),
  )
  for ax, (title, ylabel) in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("generation budget (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_xticks(budgets)
  for ax in axes[2:]:
    ax.legend(fontsize=7)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return path


def dose_response_figure(points: Sequence[dict], path: str) -> str:
  """The mismatch dose-response with the trainer fixed at bf16: per rollout (one dict each:
  `label`, `kl` (k3 KL of its rows under the trainer, mean over the learning runs), `diff`,
  `lo`, `hi` (the paired difference of the test's primary outcome from bf16, with its 95%
  interval) and optionally `grad_cosine` (experiments/gradient_study.py's cosine to the
  gradient on the trainer's own rows at the same length)), against the dose on a log axis."""
  plt = off_screen()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for i, p in enumerate(points):
    c = plt.cm.tab10(i % 10)
    y, lo, hi = 100 * p["diff"], 100 * p["lo"], 100 * p["hi"]
    axes[0].errorbar([p["kl"]], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=4, color=c,
                     label=p["label"])  # fmt: skip
    if p.get("grad_cosine") is not None:
      axes[1].plot([p["kl"]], [p["grad_cosine"]], "o", color=c, label=p["label"])
  axes[0].axhline(0, color="k", lw=0.8)
  axes[0].axhline(-5, color="grey", ls=":", lw=0.8, label="-5 points (the test's margin)")
  axes[0].set_ylabel("training reward, last 10 steps: - bf16 (points)")
  axes[0].set_title("learning, paired over seeds (95% CI)", fontsize=10)
  axes[1].set_ylabel("cosine to the gradient on bf16's own rows")
  axes[1].set_title("one batch's gradient (149 tokens)", fontsize=10)
  for ax in axes:
    ax.set_xscale("log")
    ax.set_xlabel("mismatch: k3 KL(rollout || bf16 trainer) per token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return path
