"""PNG plots of a run's metrics.jsonl: reward / accuracy, agreement, position profile, time."""

from __future__ import annotations

import os

import numpy as np

from jetrl.train.writers import read_jsonl


def _series(records, key):
  xs = [r["step"] for r in records if isinstance(r.get(key), (int, float))]
  ys = [r[key] for r in records if isinstance(r.get(key), (int, float))]
  return np.asarray(xs), np.asarray(ys, dtype=float)


def write_plots(workdir: str) -> list[str]:
  """Draw the plots from `<workdir>/metrics.jsonl` (and eval.jsonl); return the PNG paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise ValueError(f"no metrics.jsonl in {workdir}: nothing to plot")
  recs = read_jsonl(path)
  evals = read_jsonl(os.path.join(workdir, "eval.jsonl")) if os.path.exists(
      os.path.join(workdir, "eval.jsonl")) else []
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  paths = []

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key, label in (("reward_mean", "train reward"), ("accuracy", "train accuracy")):
    ax.plot(*_series(recs, key), label=label)
  if evals:
    ax.plot(*_series(evals, "eval_accuracy"), "o-", label="held-out greedy accuracy")
  ax.set_xlabel("step"), ax.set_ylim(-0.02, 1.02), ax.legend(), ax.grid(alpha=0.3)
  ax.set_title("Reward and accuracy")
  paths.append(_save(fig, out_dir, "reward.png"))

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key in ("agree/abs_diff_mean", "agree/abs_diff_max", "agree/kl_k3"):
    x, y = _series(recs, key)
    if len(x):
      ax.semilogy(x, np.maximum(y, 1e-12), label=key.split("/")[1])
  ax.set_xlabel("step"), ax.legend(), ax.grid(alpha=0.3)
  ax.set_title("Rollout vs training forward: |Δ log p|, k3 KL")
  paths.append(_save(fig, out_dir, "agreement.png"))

  bins = [r for r in recs if "agree/bin_abs_diff_mean" in r]
  if bins:
    means = np.asarray([r["agree/bin_abs_diff_mean"] for r in bins], float)
    counts = np.asarray([r["agree/bin_count"] for r in bins], float)
    prof = (means * counts).sum(0) / np.maximum(counts.sum(0), 1)
    edges = recs[-1].get("agree/bin_edges") or list(range(len(prof)))
    keep = counts.sum(0) > 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.asarray(edges[:len(prof)])[keep], prof[keep], "o-")
    ax.set_xscale("symlog"), ax.set_xlabel("token position (bin start)")
    ax.set_ylabel("mean |Δ log p|"), ax.grid(alpha=0.3)
    ax.set_title("Mismatch by token position (whole run)")
    paths.append(_save(fig, out_dir, "agreement_by_position.png"))

  fig, ax = plt.subplots(figsize=(6, 3.5))
  bottom = None
  for key in ("time/rollout", "time/reward", "time/update"):
    x, y = _series(recs, key)
    if len(x):
      ax.bar(x, y, bottom=bottom, label=key.split("/")[1])
      bottom = y if bottom is None else bottom + y
  ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.legend(), ax.set_title("Time per step")
  paths.append(_save(fig, out_dir, "time.png"))
  return paths


def _save(fig, out_dir, name):
  import matplotlib.pyplot as plt
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path
