"""The precision-flow study: the same RL experiment under several precision recipes, rollout
lengths and seeds, each from a shared supervised warm start; then one report directory with
tables (report.md), per-combination results (results.json) and PNG plots.

  from jetrl.train.study import StudyConfig, run_study
  run_study(StudyConfig(report_dir="runs/study", lengths=(3, 8)))

`experiments/compare_precisions.py` is the command-line front end (one flag per field).

Layout of the report directory:

  sft/L{length}/                     the warm start of that length (skipped if present)
  runs/L{length}/{recipe}/seed{s}/   one RL run (`jetrl.train.run`'s workdir)
  results.json                       one row per finished combination (the aggregates' source)
  report.md, *.png                   the report

A combination whose workdir holds `summary.json` is done and is not run again; an unfinished one
resumes from its own checkpoints (`run` does that). A recipe spec is a recipe name, optionally
followed by `+` and an importance-sampling correction: `fp8_rollout+tis`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from jetrl.precision import RECIPES
from jetrl.rl.correction import IS_METHODS
from jetrl.train.writers import read_jsonl

DEFAULT_RECIPES = ("bf16", "fp8_rollout", "fp8_rollout+tis", "jet", "fp8_tensor")


def _f(default, help_text: str):
  return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  report_dir: str = _f("", "Output directory of the study (runs, warm starts, report).")
  recipes: tuple = _f(DEFAULT_RECIPES, "Recipe specs: a recipe name, optionally '+<is_correction>'.")
  lengths: tuple = _f((3, 8), "Values of the task's length knob (rollout length grows with it).")
  seeds: tuple = _f((0,), "RL seeds (the warm start is shared by all seeds of a length).")
  task: str = _f("addition", "Synthetic task: addition, multiplication or sorting.")
  difficulty: int = _f(1, "Synthetic task difficulty knob.")
  model: str = _f("tiny", "Model preset.")
  n_layers: int = _f(0, "Override the preset's number of layers (0: keep).")
  token_margin: int = _f(8, "max_new_tokens = the task's longest gold completion + eos + margin.")
  # RL.
  steps: int = _f(40, "RL steps per combination.")
  prompts_per_step: int = _f(8, "Prompts per RL step.")
  group_size: int = _f(8, "Samples per prompt.")
  temperature: float = _f(0.7, "Rollout temperature.")
  lr: float = _f(5e-5, "RL learning rate.")
  loss: str = _f("grpo", "Policy loss.")
  is_cap: float = _f(2.0, "Cap of the importance-sampling correction (recipes with '+tis' etc.).")
  eval_every: int = _f(10, "Greedy evaluation every N steps.")
  eval_size: int = _f(64, "Held-out problems per greedy evaluation.")
  # Warm start.
  sft_steps: int = _f(300, "Supervised warm-start steps per length.")
  sft_batch_size: int = _f(32, "Warm-start batch size.")
  sft_lr: float = _f(1e-3, "Warm-start peak learning rate.")
  sft_seed: int = _f(0, "Warm-start seed.")
  # Report.
  target_accuracy: float = _f(0.5, "Greedy accuracy whose first crossing is reported (steps to target).")
  collapse_ratio: float = _f(0.1, "A run whose final greedy accuracy is below this fraction of its "
                             "best (best >= 0.1) counts as collapsed.")
  time_budget_s: float = _f(0.0, "Stop starting new combinations after this many seconds (0: none).")
  command: str = _f("", "The command line that produced the study (written into report.md).")

  def validate(self) -> StudyConfig:
    from jetrl.data import TASKS
    if not self.report_dir:
      raise ValueError("--report_dir: is required")
    for spec in self.recipes:
      parse_recipe(spec)
    if not self.recipes or not self.lengths or not self.seeds:
      raise ValueError("--recipes, --lengths and --seeds must each be non-empty")
    if self.task not in TASKS or self.task in ("gsm8k", "math500"):
      raise ValueError(f"--task: {self.task!r} is not a synthetic task "
                       "(addition, multiplication, sorting)")
    if any(int(x) < 0 for x in self.lengths):
      raise ValueError(f"--lengths: must be >= 0, got {self.lengths}")
    if self.steps < 1 or self.sft_steps < 1:
      raise ValueError("--steps and --sft_steps must be >= 1")
    if self.time_budget_s < 0:
      raise ValueError(f"--time_budget_s: must be >= 0, got {self.time_budget_s}")
    return self


def parse_recipe(spec: str) -> tuple[str, str]:
  """'fp8_rollout+tis' -> ('fp8_rollout', 'tis'); 'jet' -> ('jet', 'none')."""
  name, _, corr = str(spec).partition("+")
  corr = corr or "none"
  if name not in RECIPES:
    raise ValueError(f"--recipes: {spec!r}: unknown recipe {name!r}; choose one of {list(RECIPES)}")
  if corr not in IS_METHODS:
    raise ValueError(f"--recipes: {spec!r}: unknown correction {corr!r}; choose one of "
                     f"{list(IS_METHODS)}")
  return name, corr


def max_new_tokens_for(cfg: StudyConfig, length: int) -> int:
  """Generation budget at a length setting: longest gold completion + eos + margin (tokens of
  the character tokenizer are characters)."""
  from jetrl.data import get_task
  task = get_task(cfg.task, difficulty=cfg.difficulty, length=int(length), seed=0)
  return int(task.max_completion_chars) + 1 + cfg.token_margin


def sft_dir(cfg: StudyConfig, length: int) -> str:
  return os.path.join(cfg.report_dir, "sft", f"L{length}")


def run_dir(cfg: StudyConfig, length: int, spec: str, seed: int) -> str:
  return os.path.join(cfg.report_dir, "runs", f"L{length}", spec, f"seed{seed}")


def train_config(cfg: StudyConfig, length: int, spec: str, seed: int):
  from jetrl.train.config import TrainConfig
  name, corr = parse_recipe(spec)
  return TrainConfig(
      recipe=name, is_correction=corr, is_cap=cfg.is_cap, model=cfg.model,
      n_layers=cfg.n_layers, init_from=sft_dir(cfg, length), task=cfg.task,
      difficulty=cfg.difficulty, length=int(length), steps=cfg.steps,
      prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
      max_new_tokens=max_new_tokens_for(cfg, length), temperature=cfg.temperature,
      loss=cfg.loss, lr=cfg.lr, seed=int(seed), workdir=run_dir(cfg, length, spec, seed),
      eval_every=cfg.eval_every, eval_size=cfg.eval_size, ckpt_every=max(cfg.steps // 2, 1),
      keep_ckpts=1, tensorboard=False, plots=False)


def sft_config(cfg: StudyConfig, length: int):
  from jetrl.train.sft import SFTConfig
  return SFTConfig(model=cfg.model, n_layers=cfg.n_layers, task=cfg.task,
                   difficulty=cfg.difficulty, length=int(length), recipe="bf16",
                   steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr,
                   max_new_tokens=max_new_tokens_for(cfg, length), eval_size=cfg.eval_size,
                   seed=cfg.sft_seed, workdir=sft_dir(cfg, length))


# --------------------------------------------------------------------------------------------
# Running the grid.

def combinations(cfg: StudyConfig) -> list[tuple[int, str, int]]:
  """Run order: seed, then recipe, then length, so that a study cut short by its time budget
  has every length of its first recipes (the length comparison is the study's point)."""
  return [(int(L), spec, int(s)) for s in cfg.seeds for spec in cfg.recipes for L in cfg.lengths]


def is_done(cfg: StudyConfig, length: int, spec: str, seed: int) -> bool:
  return os.path.exists(os.path.join(run_dir(cfg, length, spec, seed), "summary.json"))


def run_study(cfg: StudyConfig, *, log: Callable = print, quiet_runs: bool = False) -> dict:
  """Run every (length, recipe, seed) not done yet, one after another, then write the report.

  Stops starting new combinations (warm starts included) once `time_budget_s` is exceeded; the
  report then lists what was not run. Returns {"report": path, "rows": [...], "not_run": [...]}.
  """
  from jetrl.train.loop import run
  from jetrl.train.sft import run_sft

  cfg = cfg.validate()
  os.makedirs(cfg.report_dir, exist_ok=True)
  with open(os.path.join(cfg.report_dir, "study_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)
  sub_log = (lambda *a, **k: None) if quiet_runs else log
  t_start = time.time()
  combos = combinations(cfg)
  not_run, budget_hit = [], False
  timing = _read_timing(cfg)

  def over_budget():
    return cfg.time_budget_s > 0 and time.time() - t_start > cfg.time_budget_s

  for i, (L, spec, seed) in enumerate(combos):
    tag = f"L{L}/{spec}/seed{seed}"
    if is_done(cfg, L, spec, seed):
      log(f"[{i + 1}/{len(combos)}] {tag}: done already, skipped")
      continue
    if over_budget():
      budget_hit = True
      not_run.append(tag)
      log(f"[{i + 1}/{len(combos)}] {tag}: not started (time budget {cfg.time_budget_s:.0f}s "
          "exceeded)")
      continue
    if not os.path.exists(os.path.join(sft_dir(cfg, L), "sft_summary.json")):
      log(f"warm start for length {L}: {cfg.sft_steps} SFT steps -> {sft_dir(cfg, L)}")
      t0 = time.time()
      res = run_sft(sft_config(cfg, L), log=sub_log)
      timing[f"sft/L{L}"] = time.time() - t0
      _write_timing(cfg, timing)
      log(f"warm start for length {L}: greedy accuracy {res['eval_accuracy']:.3f} "
          f"({time.time() - t0:.0f}s)")
    elapsed = time.time() - t_start
    log(f"[{i + 1}/{len(combos)}] {tag}: running (study elapsed {elapsed:.0f}s)")
    t0 = time.time()
    summary = run(train_config(cfg, L, spec, seed), log=sub_log)
    timing[tag] = timing.get(tag, 0.0) + time.time() - t0
    _write_timing(cfg, timing)
    log(f"[{i + 1}/{len(combos)}] {tag}: greedy accuracy {summary['eval_before']:.3f} -> "
        f"{summary['eval_after']:.3f}, skipped updates {summary['skipped_updates']} "
        f"({time.time() - t0:.0f}s)")
  rows = collect(cfg)
  path = write_report(cfg, rows, not_run=not_run, budget_hit=budget_hit,
                      study_wall_s=time.time() - t_start)
  log(f"report: {path}")
  return {"report": path, "rows": rows, "not_run": not_run}


def _timing_path(cfg):
  return os.path.join(cfg.report_dir, "timing.json")


def _read_timing(cfg) -> dict:
  p = _timing_path(cfg)
  if os.path.exists(p):
    with open(p) as f:
      return json.load(f)
  return {}


def _write_timing(cfg, timing: dict) -> None:
  with open(_timing_path(cfg), "w") as f:
    json.dump(timing, f, indent=1)


# --------------------------------------------------------------------------------------------
# Aggregation.

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
  why = [w for w, c in (("non-finite", not finite), (f"{int(skipped)} skipped", skipped > 0),
                        ("collapsed", collapsed)) if c]
  # Time per step, leaving out step 1 (compilation) when there is more than one step.
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
      steps=len(recs), eval_steps=ev_steps, eval_accuracy=ev_acc,
      eval_initial=ev_acc[0] if ev_acc else float("nan"), eval_final=final, eval_best=best,
      steps_to_target=hit[0] if hit else None,
      diverged=diverged, diverged_why=why, skipped_updates=skipped,
      abs_diff_mean=float(np.mean(col("agree/abs_diff_mean"))),
      abs_diff_max=float(np.max(col("agree/abs_diff_max"))),
      kl_k3=float(np.mean(col("agree/kl_k3"))),
      reward_last=float(np.mean([r["reward_mean"] for r in last])),
      train_acc_last=float(np.mean([r["accuracy"] for r in last])),
      response_length=float(np.mean(col("response_length"))),
      time_rollout=t("time/rollout"), time_reward=t("time/reward"), time_update=t("time/update"),
      step_series=[int(r["step"]) for r in recs],
      reward_series=[float(r["reward_mean"]) for r in recs],
      acc_series=[float(r["accuracy"]) for r in recs],
      abs_diff_series=[float(r["agree/abs_diff_mean"]) for r in recs],
      kl_series=[float(r["agree/kl_k3"]) for r in recs],
      position_profile=prof, position_edges=edges)


def collect(cfg: StudyConfig) -> list[dict]:
  """One row per finished combination; also written to results.json."""
  timing = _read_timing(cfg)
  rows = []
  for L, spec, seed in combinations(cfg):
    if not is_done(cfg, L, spec, seed):
      continue
    row = dict(length=L, recipe=spec, seed=seed, max_new_tokens=max_new_tokens_for(cfg, L),
               wall_s=timing.get(f"L{L}/{spec}/seed{seed}"),
               **summarize_run(cfg, run_dir(cfg, L, spec, seed)))
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
    out.append(dict(
        length=L, recipe=spec, n_seeds=len(rs), max_new_tokens=rs[0]["max_new_tokens"],
        eval_initial=init, eval_final=acc, eval_final_sd=acc_sd,
        steps_to_target=[h for h in hits], n_diverged=sum(r["diverged"] for r in rs),
        diverged_why=sorted({w for r in rs for w in r["diverged_why"]}),
        abs_diff_mean=float(np.mean([r["abs_diff_mean"] for r in rs])),
        abs_diff_max=float(np.max([r["abs_diff_max"] for r in rs])),
        kl_k3=float(np.mean([r["kl_k3"] for r in rs])),
        reward_last=float(np.mean([r["reward_last"] for r in rs])),
        response_length=float(np.mean([r["response_length"] for r in rs])),
        time_rollout=float(np.mean([r["time_rollout"] for r in rs])),
        time_reward=float(np.mean([r["time_reward"] for r in rs])),
        time_update=float(np.mean([r["time_update"] for r in rs])),
        wall_s=float(np.mean([r["wall_s"] for r in rs if r.get("wall_s") is not None] or [np.nan]))))
  return out


# --------------------------------------------------------------------------------------------
# Report.

TABLE_HEADER = ("| recipe | seeds | greedy acc @0 | final greedy acc | steps to target | diverged | "
                "mean \\|Δlog p\\| | max \\|Δlog p\\| | ≈ Σ\\|Δlog p\\| per seq. | k3 KL | train reward (last 10) | "
                "resp. len | rollout s/step | update s/step | wall s/run |")


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
        f" ({', '.join(a['diverged_why'])})" if a["diverged_why"] else "")
    lines.append(
        f"| {a['recipe']} | {a['n_seeds']} | {_fmt(a['eval_initial'])} | {acc} | {hit} | {div} | "
        f"{_fmt(a['abs_diff_mean'], '.2e')} | {_fmt(a['abs_diff_max'], '.2e')} | "
        f"{_fmt(a['abs_diff_mean'] * a['response_length'], '.2e')} | "
        f"{_fmt(a['kl_k3'], '.2e')} | {_fmt(a['reward_last'])} | {_fmt(a['response_length'], '.1f')} | "
        f"{_fmt(a['time_rollout'], '.2f')} | {_fmt(a['time_update'], '.2f')} | "
        f"{_fmt(a['wall_s'], '.0f')} |")
  return "\n".join(lines)


def write_report(cfg: StudyConfig, rows: Sequence[dict], *, not_run: Sequence[str] = (),
                 budget_hit: bool = False, study_wall_s: float | None = None) -> str:
  agg = aggregate(rows)
  plots = write_plots(cfg, rows, agg) if rows else []
  timing = _read_timing(cfg)
  out = ["# Precision-flow study", "",
         "Produced by:", "", "```", cfg.command or "(run_study called from Python)", "```", "",
         f"Task `{cfg.task}` (difficulty {cfg.difficulty}), model `{cfg.model}`"
         + (f" with {cfg.n_layers} layers" if cfg.n_layers else "")
         + f"; RL: {cfg.steps} steps, {cfg.prompts_per_step} prompts x {cfg.group_size} samples,"
         f" loss {cfg.loss}, lr {cfg.lr:g}, temperature {cfg.temperature:g}, greedy eval on "
         f"{cfg.eval_size} held-out problems every {cfg.eval_every} steps; warm start: "
         f"{cfg.sft_steps} bf16 SFT steps (batch {cfg.sft_batch_size}, lr {cfg.sft_lr:g}), one per "
         "length, shared by every recipe and seed of that length. Recipes: "
         + ", ".join(f"`{r}`" for r in cfg.recipes) + f"; seeds: {list(cfg.seeds)}.", "",
         (f"Columns: greedy accuracy on held-out problems at step 0 and at the end (mean ± sample "
         f"std over seeds); the first evaluated step with greedy accuracy ≥ {cfg.target_accuracy:g} "
         f"per seed; diverged = any non-finite metric, a skipped update, or a final greedy accuracy "
         f"below {cfg.collapse_ratio:g} x the run's best; |Δlog p| = |rollout log-prob − training "
         "forward log-prob| of the sampled tokens (mean over steps of the per-step mean; max over "
         "all tokens of the run; Σ per sequence = mean × mean response length, the size of a "
         "sequence-level log importance ratio); k3 KL between the rollout and training policies (mean over steps); "
         "time per step excludes the first (compiling) step."), ""]
  if budget_hit or not_run:
    out += [f"**Time budget ({cfg.time_budget_s:.0f} s) exceeded: {len(not_run)} "
            f"combination(s) not run:** " + ", ".join(not_run), ""]
  for L in cfg.lengths:
    sub = [a for a in agg if a["length"] == int(L)]
    sft_acc = None
    p = os.path.join(sft_dir(cfg, L), "sft_summary.json")
    if os.path.exists(p):
      with open(p) as f:
        sft_acc = json.load(f).get("eval_accuracy")
    out += [f"## Length {L} (max_new_tokens {max_new_tokens_for(cfg, L)})", "",
            f"Warm start greedy accuracy (bf16 rollout): {_fmt(sft_acc)}"
            + (f"; SFT time {timing[f'sft/L{L}']:.0f} s" if f"sft/L{L}" in timing else ""), ""]
    out += [format_table(sub, cfg.target_accuracy) if sub else "(no finished runs)", ""]
  if study_wall_s is not None:
    total = sum(timing.values())
    out += [(f"Wall time of this invocation: {study_wall_s:.0f} s; recorded wall time of all "
             f"runs and warm starts: {total:.0f} s."), ""]
  if plots:
    out += ["## Figures", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    out.append("")
  path = os.path.join(cfg.report_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(out))
  return path


def _smooth(y, k=5):
  y = np.asarray(y, float)
  if len(y) < k:
    return y
  c = np.convolve(y, np.ones(k) / k, mode="valid")
  return np.concatenate([np.full(k - 1, np.nan), c])


def write_plots(cfg: StudyConfig, rows: Sequence[dict], agg: Sequence[dict]) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recipes = [r for r in cfg.recipes if any(x["recipe"] == r for x in rows)]
  colors = {r: plt.cm.tab10(i % 10) for i, r in enumerate(cfg.recipes)}
  lengths = [int(L) for L in cfg.lengths if any(x["length"] == int(L) for x in rows)]
  paths = []

  def save(fig, name):
    p = os.path.join(cfg.report_dir, name)
    fig.tight_layout()
    fig.savefig(p, dpi=72)
    plt.close(fig)
    paths.append(p)

  def seed_mean(rs, key, xkey):
    n = min(len(r[key]) for r in rs)
    return np.asarray(rs[0][xkey][:n]), np.mean([r[key][:n] for r in rs], axis=0)

  # Accuracy and reward against step, one row of panels per length.
  fig, axes = plt.subplots(len(lengths), 2, figsize=(9, 2.8 * len(lengths)), squeeze=False)
  for i, L in enumerate(lengths):
    for spec in recipes:
      rs = [r for r in rows if r["length"] == L and r["recipe"] == spec]
      if not rs:
        continue
      x, y = seed_mean(rs, "reward_series", "step_series")
      axes[i, 0].plot(x, _smooth(y), color=colors[spec], label=spec)
      x, y = seed_mean(rs, "eval_accuracy", "eval_steps")
      axes[i, 1].plot(x, y, "o-", color=colors[spec], label=spec)
    axes[i, 0].set_title(f"length {L}: train reward (5-step mean)", fontsize=9)
    axes[i, 1].set_title(f"length {L}: held-out greedy accuracy", fontsize=9)
    for ax in axes[i]:
      ax.set_xlabel("step"), ax.set_ylim(-0.02, 1.02), ax.grid(alpha=0.3)
  axes[0, 1].legend(fontsize=7)
  save(fig, "accuracy.png")

  # |Δlog p| against step.
  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.2), squeeze=False)
  for i, L in enumerate(lengths):
    ax = axes[0, i]
    for spec in recipes:
      rs = [r for r in rows if r["length"] == L and r["recipe"] == spec]
      if rs:
        x, y = seed_mean(rs, "abs_diff_series", "step_series")
        ax.semilogy(x, np.maximum(y, 1e-12), color=colors[spec], label=spec)
    ax.set_title(f"length {L}: mean |Δlog p| per step", fontsize=9)
    ax.set_xlabel("step"), ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  save(fig, "mismatch.png")

  # |Δlog p| against token position.
  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.2), squeeze=False)
  for i, L in enumerate(lengths):
    ax = axes[0, i]
    for spec in recipes:
      rs = [r for r in rows if r["length"] == L and r["recipe"] == spec
            and r["position_profile"] is not None]
      if not rs:
        continue
      edges = list(rs[0]["position_edges"])
      prof = np.asarray([[np.nan if v is None else v for v in r["position_profile"]] for r in rs])
      y = np.nanmean(prof, axis=0)
      keep = np.isfinite(y)
      ax.semilogy(np.arange(len(y))[keep], np.maximum(y[keep], 1e-12), "o-", color=colors[spec],
                  label=spec)
      labels = [f"{a}-{b - 1}" for a, b in itertools.pairwise(edges)] + [f"{edges[-1]}+"]
      ax.set_xticks(range(len(labels)), labels[:len(labels)])
    ax.set_xlabel("token position in the completion")
    ax.set_title(f"length {L}: mean |Δlog p| by position", fontsize=9), ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  save(fig, "mismatch_by_position.png")

  # Final accuracy by length.
  fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(lengths), 3.2))
  w = 0.8 / max(len(recipes), 1)
  for j, spec in enumerate(recipes):
    xs, ys, es = [], [], []
    for i, L in enumerate(lengths):
      a = [a for a in agg if a["length"] == L and a["recipe"] == spec]
      if a:
        xs.append(i + (j - (len(recipes) - 1) / 2) * w)
        ys.append(a[0]["eval_final"]), es.append(a[0]["eval_final_sd"])
    ax.bar(xs, ys, w, yerr=es, color=colors[spec], label=spec, capsize=2)
  ax.set_xticks(range(len(lengths)), [f"length {L}" for L in lengths])
  ax.set_ylabel("final greedy accuracy"), ax.set_ylim(0, 1.05), ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=7)
  save(fig, "final_accuracy.png")
  return paths
