"""PNG plots of a run's metric records: reward / accuracy, rollout-vs-training agreement, the
agreement by token position, time per step, and the SFT loss.

Every plot is FIGSIZE inches at DPI (1000 x 500 pixels and more), labels both axes, draws each
series in its own colour, line style and marker (train reward and train accuracy stay two lines
when their values are equal, and the legend then says they coincide) and keeps its legend
outside the data (right of the axes). On agreement.png's log axis a value at or below 1e-12
(k3 is often exactly 0) is drawn on a labelled floor line, its count in the legend. A log
axis is used only where values span orders of magnitude; a handful of position bins is drawn
as categories on linear axes. The first step a process runs compiles the sampler and the
update (`time/compiled` in its record): time.png hatches that bar, and when it would dwarf the
others, clips it and prints its height, so the steady-state time stays readable.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

from jetrl.rl import metrics as names
from jetrl.train.run_files import own_dir
from jetrl.train.writers import read_jsonl
from jetrl.train.nodes import EvalConfig

# A compiling step this many times the median step is clipped in time.png.
CLIP_FACTOR = 3.0
# agreement.png on a log axis draws values at or below this on it, said in the legend.
FLOOR = 1e-12
# reward.png's legend when train accuracy equals train reward at every step (a 0/1 reward).
COINCIDE = " (equal to train reward at every step: the two lines coincide)"
FIGSIZE = (10.0, 5.0)  # inches
DPI = 100


def _series(records, key):
  xs = [r["step"] for r in records if isinstance(r.get(key), (int, float))]
  ys = [r[key] for r in records if isinstance(r.get(key), (int, float))]
  return np.asarray(xs), np.asarray(ys, dtype=float)


class _OffScreen:
  """The two pyplot calls the plots make (`subplots`, `close`) and its colormaps, without
  pyplot: each figure is drawn on its own Agg canvas, so a notebook's pyplot backend and its
  open figures are never touched (switching pyplot to Agg once made every later `plt.show()`
  in the quickstart draw nothing)."""

  def __init__(self):
    import matplotlib.cm  # pylint: disable=import-outside-toplevel
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

    self.cm, self._figure = matplotlib.cm, Figure

  def subplots(self, *args, figsize=None, **kwargs):
    fig = self._figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)

  def close(self, fig) -> None:
    pass  # nothing holds it: pyplot never saw it


def off_screen() -> _OffScreen:
  """Figures off pyplot (`_OffScreen`): what every plot of a run or a study draws on."""
  return _OffScreen()


def legend_outside(ax, **kw) -> None:
  """The legend to the right of the axes (never over the data)."""
  if ax.get_legend_handles_labels()[0]:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, **kw)


def use_log_scale(values: Sequence[float], span: float = 30.0) -> bool:
  """True when the positive values span more than `span` x (a log axis then reads better)."""
  v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], float)
  return len(v) > 1 and v.max() / v.min() > span


def bin_labels(edges: Sequence[int]) -> list[str]:
  """'0-15', '16-31', ..., '64+' for bins starting at `edges`."""
  edges = list(edges)
  return [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]


def save(fig, path: str) -> str:
  plt = off_screen()
  own_dir(os.path.dirname(path))  # a link planted as plots/ is refused, not followed
  tmp = f"{path}.tmp-{os.getpid()}"  # renamed over `path`: a link there is replaced, not followed
  if os.path.lexists(tmp):
    os.unlink(tmp)
  fig.savefig(tmp, dpi=DPI, bbox_inches="tight", format=os.path.splitext(path)[1][1:] or "png")
  plt.close(fig)
  os.replace(tmp, path)
  return path


def run_eval_label(workdir: str) -> str:
  """What the run's evaluation measured (`EvalConfig.label`: greedy, or at a temperature), from
  `<workdir>/config.json`; "greedy accuracy" when it has none."""
  path = os.path.join(workdir, "config.json")
  ev = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      ev = json.load(f).get("eval") or {}
  return EvalConfig(**{k: ev[k] for k in ("temperature", "samples") if k in ev}).label


def write_plots(workdir: str, eval_label: Optional[str] = None) -> list[str]:
  """Draw the plots from `<workdir>/metrics.jsonl` (and eval.jsonl); return the PNG paths.

  eval_label: what the evaluation measured, for reward.png's legend (`EvalConfig.label`;
    None: read from the run's config.json)."""
  plt = off_screen()
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise ValueError(f"no metrics.jsonl in {workdir}: nothing to plot")
  recs = read_jsonl(path)
  eval_path = os.path.join(workdir, "eval.jsonl")
  evals = read_jsonl(eval_path) if os.path.exists(eval_path) else []
  out_dir = os.path.join(workdir, "plots")
  paths = []

  fig, ax = plt.subplots(figsize=FIGSIZE)
  drawn = [0.0, 1.0]
  reward, accuracy = _series(recs, "reward_mean"), _series(recs, "accuracy")
  same = len(reward[0]) > 0 and all(np.array_equal(a, b) for a, b in zip(reward, accuracy))
  for (x, y), label, style in (
    (reward, "train reward", dict(color="tab:blue", linestyle="-", linewidth=3.0, alpha=0.6)),
    (
      accuracy,
      "train accuracy" + (COINCIDE if same else ""),
      dict(color="tab:orange", linestyle="--", marker="s", ms=3, linewidth=1.2),
    ),
  ):
    ax.plot(x, y, label=label, **style)
    drawn += [v for v in y if np.isfinite(v)]
  if evals:
    label = eval_label if eval_label is not None else run_eval_label(workdir)
    ax.plot(*_series(evals, "eval_accuracy"), "o-", color="tab:green", label=f"held-out {label}")
  # Accuracy is in [0, 1]; a shaped or user reward may leave it.
  ax.set_ylim(min(drawn) - 0.02, max(drawn) + 0.02)
  ax.set_xlabel("RL step"), ax.set_ylabel("reward / accuracy")
  ax.grid(alpha=0.3), ax.set_title("Reward and accuracy")
  legend_outside(ax)
  paths.append(save(fig, os.path.join(out_dir, "reward.png")))

  fig, ax = plt.subplots(figsize=FIGSIZE)
  series = []
  for key, label, style in (
    (names.agree(names.ABS_DIFF_MEAN), "mean |Δ log p|", dict(linestyle="-", marker="o")),
    (names.agree(names.ABS_DIFF_MAX), "max |Δ log p|", dict(linestyle="--", marker="^")),
    (names.agree(names.KL_K3), "k3 KL", dict(linestyle=":", marker="s")),
  ):
    x, y = _series(recs, key)
    if len(x):
      series.append((x, y, label, style))
  log = use_log_scale([v for _, y, _, _ in series for v in y])
  floored = False
  for x, y, label, style in series:
    if log:  # a log axis cannot draw 0 (k3 is often 0 in float32 for tiny gaps)
      low = y <= FLOOR
      floored = floored or bool(low.any())
      y = np.maximum(y, FLOOR)
      if low.any():
        label += f" ({int(low.sum())} steps at or below {FLOOR:g}: drawn on the floor)"
    ax.plot(x, y, label=label, ms=3, **style)
  if floored:
    ax.axhline(FLOOR, color="0.5", linewidth=0.8, linestyle="-.", label=f"floor {FLOOR:g}")
  if log:
    ax.set_yscale("log")
  ax.set_xlabel("RL step"), ax.set_ylabel("nats (per sampled token)"), ax.grid(alpha=0.3)
  ax.set_title("Rollout vs training forward")
  legend_outside(ax)
  paths.append(save(fig, os.path.join(out_dir, "agreement.png")))

  bin_mean, bin_count = names.agree(names.BIN_ABS_DIFF_MEAN), names.agree(names.BIN_COUNT)
  bins = [r for r in recs if bin_mean in r]
  if bins:
    means = np.asarray([r[bin_mean] for r in bins], float)
    counts = np.asarray([r[bin_count] for r in bins], float)
    prof = (means * counts).sum(0) / np.maximum(counts.sum(0), 1)
    edges = bins[-1].get(names.AGREE_PREFIX + "bin_edges") or list(range(len(prof)))
    keep = counts.sum(0) > 0
    labels = np.asarray(bin_labels(edges[: len(prof)]))
    fig, ax = plt.subplots(figsize=(max(FIGSIZE[0], 1.5 + 0.9 * int(keep.sum())), FIGSIZE[1]))
    ax.bar(np.arange(int(keep.sum())), prof[keep], color="tab:blue")
    ax.set_xticks(np.arange(int(keep.sum())), labels[keep])
    if use_log_scale(prof[keep]):
      ax.set_yscale("log")
    ax.set_xlabel("token position in the completion"), ax.set_ylabel("mean |Δ log p|")
    ax.grid(alpha=0.3, axis="y"), ax.set_title("Mismatch by position (whole run)")
    paths.append(save(fig, os.path.join(out_dir, "agreement_by_position.png")))

  paths.append(_time_plot(plt, recs, os.path.join(out_dir, "time.png")))
  return paths


def _time_plot(plt, recs: list[dict], path: str) -> str:
  steps = np.asarray([r["step"] for r in recs])
  parts = [
    (k.split("/")[1], np.asarray([float(r.get(k, 0.0)) for r in recs]))
    for k in ("time/rollout", "time/reward", "time/update")
  ]
  total = sum(y for _, y in parts)
  compiled = np.asarray([bool(r.get("time/compiled", 0.0)) for r in recs])
  steady = total[~compiled]
  fig, ax = plt.subplots(figsize=FIGSIZE)
  bottom = np.zeros(len(recs))
  for label, y in parts:
    ax.bar(steps, y, bottom=bottom, label=label)
    bottom = bottom + y
  if compiled.any():
    ax.bar(
      steps[compiled],
      total[compiled],
      fill=False,
      hatch="//",
      edgecolor="0.3",
      label="includes compilation",
    )
    if len(steady) and total[compiled].max() > CLIP_FACTOR * np.median(steady):
      top = 1.3 * steady.max()
      ax.set_ylim(0, top)
      for s, t in zip(steps[compiled], total[compiled]):
        ax.annotate(
          f"{t:.0f}s (clipped)",
          xy=(s, top),
          xytext=(3, 2),
          textcoords="offset points",
          ha="left",
          va="bottom",
          fontsize=7,
          annotation_clip=False,
        )
  ax.set_xlabel("RL step"), ax.set_ylabel("seconds"), ax.set_title("Time per step")
  legend_outside(ax)
  return save(fig, path)


def write_sft_plots(workdir: str) -> list[str]:
  """The SFT loss and learning rate from `<workdir>/sft_metrics.jsonl`."""
  plt = off_screen()
  recs = read_jsonl(os.path.join(workdir, "sft_metrics.jsonl"))
  fig, ax = plt.subplots(figsize=FIGSIZE)
  ax.plot(*_series(recs, "loss"), "o-", label="loss", color="tab:blue")
  ax.set_xlabel("SFT step"), ax.set_ylabel("loss (nats per token)"), ax.grid(alpha=0.3)
  if use_log_scale(_series(recs, "loss")[1]):
    ax.set_yscale("log")
  lr = ax.twinx()
  lr.plot(*_series(recs, "learning_rate"), "--", label="learning rate", color="tab:orange")
  lr.set_ylabel("learning rate")
  handles = ax.get_legend_handles_labels()[0] + lr.get_legend_handles_labels()[0]
  ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.15, 1.0), fontsize=8)
  ax.set_title("Supervised warm start")
  return [save(fig, os.path.join(workdir, "plots", "sft.png"))]
