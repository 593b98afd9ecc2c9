"""The fourth round's report (docs/study/round4/prereg.md): one table a newcomer can read, every
verdict in full, and the figures — learning curves by arm with 95% intervals, the paired effects
against the margin, and the crossover's effect against its dose.

Nothing here decides a verdict: the verdicts are `jetrl.study.prereg4`'s, computed by
`experiments/round4.py --judge` from the kept runs, and this module only lays them out. A part
with fewer whole units than its design is reported as such ("k of n runs"), and a part with no
verdict says why (not yet run, or its gate).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from jetrl.study.prereg4 import OUTCOMES
from jetrl.study.stats import paired_interval
from jetrl.train.plots import off_screen

MARGIN_POINTS = 5.0
# The primary part's arms, then the crossover's, then the length part's, in drawing order.
ARM_ORDER = (
  "bf16",
  "bf16@recompute",
  "jet",
  "fp8_rollout",
  "jet_exact",
  "jet_exact_train",
  "jet_exact_train_bf16_rollout",
  "jet_exact_train_e5m2_rollout",
)


def pts(x: float) -> str:
  """A difference of accuracies in points, signed, one decimal ("n/a" when not a number)."""
  return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}"


def interval_text(c: Mapping) -> str:
  """'mean [lo, hi]' in points, with n."""
  if not c or c.get("n", 0) < 2:
    return f"n = {c.get('n', 0) if c else 0}: no interval"
  return f"{pts(c['mean'])} [{pts(c['lo'])}, {pts(c['hi'])}] (n = {c['n']})"


def level_text(values: Sequence[float]) -> str:
  """An accuracy's mean over seeds with its 95% t interval, three decimals."""
  c = paired_interval(values)
  if c["n"] < 2:
    return f"{c['mean']:.3f} (n = {c['n']})" if c["n"] else "none"
  return f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]"


def smollm2_table(runs: Sequence[Mapping], smol: Mapping) -> list[str]:
  """Per recipe: accuracy before and after per seed and as a mean with its interval, the gain
  and the paired difference of gains against bf16 (prereg4.judge_smollm2's), in points."""
  out = [
    "| recipe | before, seeds in order | after | before, mean [95% CI] | after, mean [95% CI] "
    "| gain, points [95% CI] | gain - bf16's gain, points [95% CI] |",
    "|---|---|---|---|---|---|---|",
  ]
  for recipe, gain in smol["gain"].items():
    mine = sorted((r for r in runs if r["recipe"] == recipe), key=lambda r: r["seed"])
    before, after = [r["before"] for r in mine], [r["after"] for r in mine]
    vs = smol.get("against_bf16", {}).get(recipe)
    out.append(
      f"| {recipe} | {' / '.join(f'{x:.3f}' for x in before)} "
      f"| {' / '.join(f'{x:.3f}' for x in after)} | {level_text(before)} | {level_text(after)} "
      f"| {interval_text(gain)} | {interval_text(vs) if vs else ''} |"
    )
  return out


def what_is_open(c: Mapping | None) -> str:
  """What a call leaves open, from its interval alone."""
  if not c or c.get("call") is None:
    return "not judged yet"
  lo = 100 * c["lo"]
  if c["call"] == "non-inferior":
    if c.get("drop_shown"):
      return f"a drop is shown, of up to {-lo:.1f} points: smaller than the margin"
    if lo < 0:
      return f"a drop of up to {-lo:.1f} points is not excluded"
    return "nothing at this margin: the interval lies above 0"
  if c["call"] == "inferior":
    return "why it learns worse (a drop of more than 5 points is shown)"
  return "whether it learns within 5 points: the interval crosses -5 (more units would tell)"


def _row(what: str, c: Mapping | None, progress: str, open_text: str | None = None) -> str:
  if not c or c.get("call") is None:
    return f"| {what} | {progress} | not judged | {open_text or 'not judged yet'} |"
  drop = "; drop shown" if c.get("drop_shown") else ""
  return f"| {what} | {interval_text(c)} | **{c['call']}**{drop} | {open_text or what_is_open(c)} |"


def _progress(verdicts: Mapping, part: str) -> str:
  p = verdicts.get("progress", {}).get(part)
  if not p:
    return "no runs"
  text = f"{p['done']} of {p['planned']} runs"
  return text + (f"; {p['note']}" if p.get("note") else "")


def _not_run(verdicts: Mapping, part: str) -> bool:
  """Whether `part` was not run by a pre-registered rule (its progress carries why)."""
  return bool((verdicts.get("progress", {}).get(part) or {}).get("note"))


def rl_effect(rows: Sequence[dict]) -> dict:
  """Descriptive, not a verdict: per warm start and arm, what RL did to the primary outcome —
  its value minus the run's own step-0 bf16-scored accuracy, with the 95% t interval over
  seeds. {warm (str): {arm: interval with "start" (mean step-0 accuracy)}}."""
  out: dict = {}
  for w in sorted({int(r["warm"]) for r in rows}):
    for arm in _arms([r for r in rows if int(r["warm"]) == w]):
      mine = [r for r in rows if int(r["warm"]) == w and r["recipe"] == arm]
      start = [r["eval_accuracy_bf16"][0] for r in mine]
      gain = [OUTCOMES["primary"](r) - a for r, a in zip(mine, start)]
      out.setdefault(str(w), {})[arm] = dict(paired_interval(gain), start=float(np.mean(start)))
  return out


def _direction(c: Mapping) -> str:
  if c.get("n", 0) < 2:
    return "unknown"
  return "raised" if c["lo"] > 0 else "lowered" if c["hi"] < 0 else "did not clearly change"


def _rl_effect_text(verdicts: Mapping) -> str:
  """Which warm starts RL raised bf16's held-out accuracy on, and which it lowered it on."""
  eff = verdicts.get("primary_rl_effect") or {}
  by: dict[str, list[str]] = {}
  for w, arms in sorted(eff.items(), key=lambda kv: int(kv[0])):
    if "bf16" in arms:
      by.setdefault(_direction(arms["bf16"]), []).append(f"w{w}")
  if not by:
    return ""
  parts = [f"{d} held-out accuracy on {', '.join(ws)}" for d, ws in by.items()]
  text = "RL under bf16 " + "; ".join(parts)
  if by.get("lowered"):
    text += " (there the arms are compared on what they lose)"
  return text


def _warm_start_caveat(verdicts: Mapping) -> str:
  ws = verdicts.get("primary_warm_starts") or {}
  used, left = ws.get("used") or [], ws.get("left_out_by_the_gate") or []
  if not left:
    return "other SFT recipes"
  return (
    f"the warm starts are the {len(used)} of {len(used) + len(left)} SFT seeds that answer "
    "at length 9 at all (the gate): other SFT recipes"
  )


def summary_table(verdicts: Mapping) -> str:
  """The newcomer's table (README and results.md): recipe, what learning showed (the paired
  interval in points of bf16-scored held-out accuracy, with its call), what is open."""
  prim = (verdicts.get("primary") or {}).get("primary") or {}
  rows = [
    "| comparison (held-out accuracy, points) | paired difference [95% CI] | call (margin 5) "
    "| what is open |",
    "|---|---|---|---|",
    _row(
      "`jet` - `bf16`, PPO ratio starting at 1 (primary)",
      prim.get("primary"),
      _progress(verdicts, "primary"),
    ),
  ]
  if prim.get("primary"):
    held = prim.get("holds_on_each_warm_start")
    het = prim.get("heterogeneity") or {}
    rows.append(
      f"| the same on each of {len(prim.get('per_warm_start', {}))} warm starts | "
      + "; ".join(
        f"w{w}: {interval_text(c)}" for w, c in sorted(prim.get("per_warm_start", {}).items())
      )
      + f" | {'holds on each' if held else 'does not hold on each'} "
      f"(ANOVA p {het.get('p') if het.get('p') is None else round(het['p'], 3)}) | "
      + "; ".join(t for t in (_rl_effect_text(verdicts), _warm_start_caveat(verdicts)) if t)
      + " |"
    )
  fam = prim.get("secondary_family") or {}
  for name in ("jet - bf16@recompute", "bf16 - bf16@recompute"):
    label = f"`{name.split(' - ')[0]}` - `{name.split(' - ')[1]}` (recomputed old log-probs)"
    rows.append(_row(label, fam.get(name), _progress(verdicts, "primary")))
  cross = (verdicts.get("crossover") or {}).get("primary") or {}
  if cross.get("verdict"):
    rows.append(
      f"| rollout mismatch alone (the exact trainer; {len(cross.get('units', []))} seeds, "
      f"{_progress(verdicts, 'crossover')}) | "
      f"the three rows below | **{cross['verdict']}** | each rollout's dose is measured "
      "(mean per-token \\|Δ log p\\|); the E5M2 rollout's decides |"
    )
  for arm, c in (cross.get("arms") or {}).items():
    dose = (cross.get("dose") or {}).get(arm)
    label = f"rollout mismatch alone: `{arm}` - `jet_exact` (dose {dose:.1e})"
    rows.append(_row(label, c, _progress(verdicts, "crossover")))
  if not cross.get("arms"):
    rows.append(
      _row(
        "rollout mismatch alone (exact trainer, 4 rollouts)", None, _progress(verdicts, "crossover")
      )
    )
  length = (verdicts.get("length") or {}).get("primary") or {}
  gated = _not_run(verdicts, "length")
  for arm in ("jet", "fp8_rollout"):
    c = (length.get("arms") or {}).get(arm)
    rows.append(
      _row(
        f"length 20 (~430 tokens): `{arm}` - `bf16`",
        c,
        _progress(verdicts, "length"),
        "all of it: the registered warm start answers nothing at length 20, so a later round "
        "needs another setting, pre-registered anew"
        if gated
        else None,
      )
    )
  smol = (verdicts.get("smollm2") or {}).get("against_bf16") or {}
  for arm in ("jet", "fp8_rollout"):
    c = smol.get(arm)
    c = dict(c, call=f"reported ({c['n']} seeds)") if c and c.get("n", 0) >= 2 else None
    rows.append(
      _row(
        f"SmolLM2-135M LoRA: gain of `{arm}` - gain of `bf16`",
        c,
        _progress(verdicts, "smollm2"),
        "only very large effects are detectable with 3 seeds" if c else None,
      )
    )
  return "\n".join(rows)


def _band(series: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per column of equal-length series (one per seed): the mean and its 95% t interval (the
  mean alone where there is one series)."""
  n = min(len(s) for s in series)
  cols = np.asarray([list(s[:n]) for s in series], float).T
  out = [paired_interval(c) for c in cols]
  mean = np.asarray([o["mean"] for o in out])
  lo = np.asarray([o["lo"] if o["n"] >= 2 else o["mean"] for o in out])
  hi = np.asarray([o["hi"] if o["n"] >= 2 else o["mean"] for o in out])
  return mean, lo, hi


def _arms(rows: Sequence[dict]) -> list[str]:
  present = {r["recipe"] for r in rows}
  return [a for a in ARM_ORDER if a in present] + sorted(present - set(ARM_ORDER))


def _colors(plt) -> dict:
  return {a: plt.cm.tab10(i % 10) for i, a in enumerate(ARM_ORDER)}


def curves_figure(rows: Sequence[dict], path: str, title: str) -> str | None:
  """One row of panels per warm start (and a pooled row when there are several): bf16-scored
  held-out accuracy at each evaluation and the training reward at each step, mean over seeds
  with its 95% t interval shaded, one colour per arm."""
  if not rows:
    return None
  plt = off_screen()
  colors = _colors(plt)
  warms = sorted({int(r["warm"]) for r in rows})
  groups = [(f"warm start w{w}", [r for r in rows if int(r["warm"]) == w]) for w in warms]
  if len(warms) > 1:
    groups.append(("pooled over warm starts", list(rows)))
  fig, axes = plt.subplots(len(groups), 2, figsize=(11, 2.9 * len(groups)), squeeze=False)
  for i, (name, rs) in enumerate(groups):
    for arm in _arms(rs):
      mine = [r for r in rs if r["recipe"] == arm]
      c = colors.get(arm)
      acc = [r["eval_accuracy_bf16"] or r["eval_accuracy"] for r in mine]
      m, lo, hi = _band(acc)
      x = np.asarray(mine[0]["eval_steps"][: len(m)])
      axes[i, 0].plot(x, m, "o-", color=c, label=arm)
      axes[i, 0].fill_between(x, lo, hi, color=c, alpha=0.15)
      m, lo, hi = _band([r["reward_series"] for r in mine])
      x = np.asarray(mine[0]["step_series"][: len(m)])
      axes[i, 1].plot(x, m, "-", color=c, label=arm)
      axes[i, 1].fill_between(x, lo, hi, color=c, alpha=0.15)
    per_arm = sorted({sum(r["recipe"] == a for r in rs) for a in _arms(rs)})
    runs = "/".join(str(k) for k in per_arm)
    axes[i, 0].set_title(
      f"{title}, {name} ({runs} runs per arm): held-out accuracy (bf16-scored)", fontsize=9
    )
    axes[i, 0].set_ylabel("accuracy")
    axes[i, 1].set_title(f"{title}, {name}: training reward", fontsize=9)
    axes[i, 1].set_ylabel("mean reward")
    for ax in axes[i]:
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
  handles, labels = axes[-1, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=8)
  fig.text(1.0, 0.2, "shaded: 95% t interval\nof the mean over seeds", fontsize=8)
  return _save(plt, fig, path)


def smollm2_figure(smol: Sequence[dict], path: str) -> str | None:
  """SmolLM2's greedy held-out accuracy at each evaluation, mean over seeds with its interval."""
  rows = [r for r in smol if r.get("curve")]
  if not rows:
    return None
  plt = off_screen()
  colors = _colors(plt)
  fig, axes = plt.subplots(1, 1, figsize=(6.5, 3.4), squeeze=False)
  ax = axes[0, 0]
  for arm in _arms(rows):
    mine = [r for r in rows if r["recipe"] == arm]
    m, lo, hi = _band([[a for _, a in r["curve"]] for r in mine])
    x = np.asarray([s for s, _ in mine[0]["curve"]][: len(m)])
    ax.plot(x, m, "o-", color=colors.get(arm), label=f"{arm} (n = {len(mine)})")
    ax.fill_between(x, lo, hi, color=colors.get(arm), alpha=0.15)
  ax.set_title("SmolLM2-135M-Instruct LoRA RL: held-out accuracy (greedy)", fontsize=9)
  ax.set_xlabel("RL step"), ax.set_ylabel("accuracy"), ax.grid(alpha=0.3)
  ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
  return _save(plt, fig, path)


def _effects(verdicts: Mapping, outcome: str) -> list[tuple[str, Mapping]]:
  """(label, interval) of every comparison with an interval, in the table's order."""
  out = []
  prim = (verdicts.get("primary") or {}).get(outcome) or {}
  if prim.get("primary"):
    out.append(("jet - bf16 (primary)", prim["primary"]))
    for w, c in sorted((prim.get("per_warm_start") or {}).items()):
      if c.get("n", 0) >= 2:
        out.append((f"  on warm start w{w}", c))
    for name, c in (prim.get("secondary_family") or {}).items():
      out.append((name, c))
  cross = (verdicts.get("crossover") or {}).get(outcome) or {}
  for arm, c in (cross.get("arms") or {}).items():
    out.append((f"{arm} - jet_exact", c))
  length = (verdicts.get("length") or {}).get(outcome) or {}
  for arm, c in (length.get("arms") or {}).items():
    out.append((f"L20: {arm} - bf16", c))
  return [(k, c) for k, c in out if c.get("n", 0) >= 2]


def effects_figure(verdicts: Mapping, path: str) -> str | None:
  """Every paired comparison's mean and 95% interval in points, for both outcomes, against the
  margin (-5) and 0."""
  panels = [
    (o, _effects(verdicts, o), t)
    for o, t in (
      ("primary", "held-out accuracy, bf16-scored (primary outcome)"),
      ("secondary", "training reward, last 10 steps (secondary)"),
    )
  ]
  panels = [p for p in panels if p[1]]
  if not panels:
    return None
  plt = off_screen()
  n = max(len(p[1]) for p in panels)
  fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 0.45 * n + 1.6))
  axes = np.atleast_1d(axes)
  same_rows = len({tuple(e[0] for e in p[1]) for p in panels}) == 1
  for i, (ax, (_, effects, title)) in enumerate(zip(axes, panels)):
    for j, (label, c) in enumerate(effects):
      y = len(effects) - 1 - j
      m, lo, hi = 100 * c["mean"], 100 * c["lo"], 100 * c["hi"]
      ax.errorbar([m], [y], xerr=[[m - lo], [hi - m]], fmt="o", color="k", capsize=3)
    labels = [e[0] for e in reversed(effects)] if i == 0 or not same_rows else []
    ax.set_yticks(range(len(effects)), labels or [""] * len(effects), fontsize=8)
    ax.axvline(0, color="k", lw=0.8)
    ax.axvline(-MARGIN_POINTS, color="tab:red", ls=":", lw=1.0, label="-5 points (the margin)")
    ax.set_xlabel("paired difference (points), mean and 95% t interval")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    left, right = ax.get_xlim()
    ax.set_xlim(min(left, -MARGIN_POINTS - 1), max(right, 1))
  axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7)
  return _save(plt, fig, path)


def dose_figure(verdicts: Mapping, path: str) -> str | None:
  """The crossover: each rollout's effect on the primary outcome against its mismatch (mean
  per-token |rollout - training log-prob|), on a log axis."""
  cross = (verdicts.get("crossover") or {}).get("primary") or {}
  arms = {a: c for a, c in (cross.get("arms") or {}).items() if c.get("n", 0) >= 2}
  dose = cross.get("dose") or {}
  points = [(a, c, dose.get(a)) for a, c in arms.items() if dose.get(a) and dose[a] > 0]
  if not points:
    return None
  plt = off_screen()
  colors = _colors(plt)
  fig, axes = plt.subplots(1, 1, figsize=(6.5, 3.4), squeeze=False)
  ax = axes[0, 0]
  for a, c, d in points:
    m, lo, hi = 100 * c["mean"], 100 * c["lo"], 100 * c["hi"]
    ax.errorbar(
      [d], [m], yerr=[[m - lo], [hi - m]], fmt="o", capsize=4, color=colors.get(a), label=a
    )
  ax.axhline(0, color="k", lw=0.8)
  ax.axhline(-MARGIN_POINTS, color="tab:red", ls=":", lw=1.0, label="-5 points (the margin)")
  ax.set_xscale("log")
  exact = dose.get("jet_exact")
  ax.set_xlabel(
    "mismatch: mean |rollout - training log p| per token"
    + (f" (jet_exact's: {exact:.1e})" if exact is not None else "")
  )
  ax.set_ylabel("held-out accuracy - jet_exact's (points)")
  ax.set_title("the exact trainer, rollouts of rising mismatch (95% CI)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
  return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=80, bbox_inches="tight")
  plt.close(fig)
  return path


def write_figures(tiny: Sequence[dict], smol: Sequence[dict], verdicts: Mapping, out_dir: str):
  """Every figure that has data, under out_dir; returns their paths."""
  part = lambda p: [r for r in tiny if r["part"] == p]
  made = [
    curves_figure(part("primary"), os.path.join(out_dir, "primary_curves.png"), "primary"),
    curves_figure(part("crossover"), os.path.join(out_dir, "crossover_curves.png"), "crossover"),
    curves_figure(part("length"), os.path.join(out_dir, "length_curves.png"), "length 20"),
    smollm2_figure(smol, os.path.join(out_dir, "smollm2_curves.png")),
    effects_figure(verdicts, os.path.join(out_dir, "effects.png")),
    dose_figure(verdicts, os.path.join(out_dir, "dose_effect.png")),
  ]
  return [p for p in made if p]


def _num(x) -> str:
  """A statistic to 3 significant digits ("n/a" when absent)."""
  return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _call_rows(title: str, items: Sequence[tuple[str, Mapping]]) -> list[str]:
  out = [
    f"### {title}",
    "",
    "| comparison | paired difference [95% CI] | p | call |",
    "|---|---|---:|---|",
  ]
  for label, c in items:
    p = c.get("p_holm", c.get("p"))
    call = c.get("call", "") + ("; drop shown" if c.get("drop_shown") else "")
    out.append(f"| {label} | {interval_text(c)} | {_num(p)} | {call} |")
  return out + [""]


def results_markdown(verdicts: Mapping, figures: Sequence[str], command: str, commit: str) -> str:
  """results.md: the summary table, then every part's comparisons for both outcomes, the
  machines, and the figures."""
  out = [
    "# The fourth round: results",
    "",
    f"Written by `{command}` at commit {commit[:12]} from the runs kept under `data/` "
    f"(pre-registration {verdicts.get('prereg_commit', '?')[:12]}: [prereg.md](prereg.md); "
    "changes since: [amendments.md](amendments.md)). Differences are in points of accuracy "
    "(or of reward); intervals are two-sided 95% Student t over paired units; the calls use the "
    "margin of 5 points.",
    "",
    "## Summary",
    "",
    summary_table(verdicts),
    "",
  ]
  progress = verdicts.get("progress") or {}
  unfinished = [p for p, v in progress.items() if v["done"] < v["planned"]]
  not_run = [p for p in unfinished if _not_run(verdicts, p)]
  unfinished = [p for p in unfinished if p not in not_run]
  if not_run:
    out += [
      "**Not run, by its pre-registered gate:** "
      + "; ".join(
        f"{p} ({progress[p]['done']} of {progress[p]['planned']} runs): "
        + progress[p]["note"].removeprefix("not run: ")
        for p in not_run
      )
      + " (prereg.md, *The length*).",
      "",
    ]
  if unfinished:
    out += [
      "**Interim:** "
      + "; ".join(f"{p}: {_progress(verdicts, p)}" for p in unfinished)
      + ". A part cut short is judged on its whole units only (prereg.md, *Cut short*).",
      "",
    ]
  ws = verdicts.get("primary_warm_starts") or {}
  if ws:
    out += [
      f"Primary warm starts: {ws.get('used')}; left out by the gate (amendments.md): "
      f"{ws.get('left_out_by_the_gate')}.",
      "",
    ]
  eff = verdicts.get("primary_rl_effect") or {}
  if eff:
    out += [
      "## What RL did on each warm start (descriptive, not a verdict)",
      "",
      "The primary outcome minus the run's own step-0 accuracy (bf16-scored), mean over seeds "
      "with its 95% t interval, in points.",
      "",
      "| warm start | arm | step-0 accuracy | change [95% CI] | |",
      "|---|---|---:|---|---|",
    ]
    for w, arms in sorted(eff.items(), key=lambda kv: int(kv[0])):
      for arm, c in arms.items():
        out.append(f"| w{w} | {arm} | {c['start']:.3f} | {interval_text(c)} | {_direction(c)} |")
    out += [""]
  out += ["## Every comparison", ""]
  for outcome, name in (("primary", "held-out accuracy"), ("secondary", "training reward")):
    items = _effects(verdicts, outcome)
    if items:
      out += _call_rows(f"{name} ({outcome} outcome)", items)
  prim = (verdicts.get("primary") or {}).get("primary") or {}
  if prim.get("heterogeneity"):
    h = prim["heterogeneity"]
    out += [
      f"Across warm starts (one-way ANOVA of the paired differences): F = {_num(h.get('F'))}, "
      f"p = {_num(h.get('p'))}; holds on each warm start: "
      f"{prim.get('holds_on_each_warm_start')}.",
      "",
    ]
  one = (verdicts.get("primary_one_machine_kind") or {}).get("primary")
  if one:
    out += [
      f"Sensitivity (units whose arms all ran on one kind of CPU): {interval_text(one)}, "
      f"{one.get('call')}.",
      "",
    ]
  smol = verdicts.get("smollm2") or {}
  if smol.get("gain"):
    out += ["### SmolLM2-135M-Instruct LoRA: greedy held-out accuracy before and after", ""]
    out += smollm2_table(verdicts.get("smollm2_runs") or [], smol) + [""]
  machines = verdicts.get("machines") or {}
  if machines:
    out += ["## Machines", ""]
    for part, m in machines.items():
      out.append(f"- {part}: {len(m['kinds'])} kind(s) of CPU; units with mixed kinds: "
                 f"{m['mixed_units'] or 'none'}")  # fmt: skip
    out += [""]
  if figures:
    out += ["## Figures", ""]
    out += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in figures]
    out += [""]
  return "\n".join(out)
