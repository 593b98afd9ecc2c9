"""The study's aggregates and its report: per-run summaries from each run's metric records,
means and spreads over seeds, paired comparisons with bf16, the verdicts, and report.md (with
the figures of `jetrl.study.plots`).

Paired comparisons. Every recipe runs the same seeds from the same warm start, so seed s of a
recipe and seed s of bf16 share their warm start, their problems and their evaluation set. The
difference of a recipe's final accuracy from bf16's is taken per seed, and its mean gets a
two-sided 95% Student t interval over the seeds (n - 1 degrees of freedom) and a paired t
test's p-value. bf16's own gain (final minus initial accuracy) gets the same interval.

Verdicts (`verdicts`; the rules are those of docs/precision_study.md, fixed before the study
was run), per length, on the bf16-scored final accuracy:
  valid       bf16 learned: its mean gain is >= `min_gain` (10 points) and its interval lies
              above 0. Otherwise the central claim is not judged ("invalid").
  mechanism   confirmed when fp8_rollout's mean |Δ log p|, |Σ Δ log p| per sequence and k3 KL
              exceed jet's in every seed; otherwise not confirmed.
  central     confirmed when the interval of fp8_rollout − bf16 lies below 0 and that of
              jet − bf16 does not; refuted at this scale when the interval of
              fp8_rollout − bf16 lies above −`smallest_drop` (3 points, the smallest drop the
              paper reports), so that no drop of that size is compatible with the data;
              otherwise inconclusive.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

from jetrl.study.config import (
  StudyConfig,
  combinations,
  is_done,
  max_new_tokens_for,
  run_dir,
  sft_dir,
  sft_length,
  sft_lengths_text,
  sft_name,
)
from jetrl.study.plots import write_plots
from jetrl.train.writers import read_jsonl

BASELINE = "bf16"
MIN_GAIN = 0.10
SMALLEST_DROP = 0.03


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


def _nan_mean(xs) -> float:
  return float(np.mean(xs)) if len(xs) else float("nan")


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
    abs_diff_mean=_nan_mean(col("agree/abs_diff_mean")),
    abs_diff_max=float(np.max(col("agree/abs_diff_max"))) if len(recs) else nan,
    seq_abs_sum_mean=_nan_mean(col("agree/seq_abs_sum_mean")),
    seq_abs_sum_max=float(np.max(col("agree/seq_abs_sum_max")))
    if len(col("agree/seq_abs_sum_max"))
    else nan,
    kl_k3=_nan_mean(col("agree/kl_k3")),
    ratio_out_frac=_nan_mean(col("agree/ratio_out_frac")),
    reward_last=float(np.mean([r["reward_mean"] for r in last])),
    train_acc_last=float(np.mean([r["accuracy"] for r in last])),
    response_length=_nan_mean(col("response_length")),
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
  xs = xs[np.isfinite(xs)]
  if not len(xs):
    return float("nan"), float("nan")
  return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> dict:
  """Mean of paired differences with its two-sided Student t interval and p-value (H0: mean 0)
  over n pairs; with fewer than two pairs the interval and p are NaN."""
  from scipy import stats  # pylint: disable=import-outside-toplevel

  d = np.asarray([x for x in diffs if x is not None and math.isfinite(x)], float)
  n = len(d)
  nan = float("nan")
  if n == 0:
    return dict(n=0, mean=nan, sd=nan, lo=nan, hi=nan, p=nan)
  mean = float(d.mean())
  if n < 2:
    return dict(n=1, mean=mean, sd=nan, lo=nan, hi=nan, p=nan)
  sd = float(d.std(ddof=1))
  se = sd / math.sqrt(n)
  half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
  if se > 0:
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
  else:
    p = 1.0 if mean == 0 else 0.0
  return dict(n=n, mean=mean, sd=sd, lo=mean - half, hi=mean + half, p=p)


def _by_seed(rows, key):
  return {r["seed"]: r[key] for r in rows}


def aggregate(rows: Sequence[dict]) -> list[dict]:
  """Rows grouped by (length, recipe) over seeds, in first-seen order, with paired comparisons
  against bf16's runs of the same length and seeds."""
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["length"], r["recipe"]), []).append(r)
  out = []
  for (L, spec), rs in groups.items():
    ms = lambda k: _mean_spread([r.get(k) for r in rs])
    acc, acc_sd = ms("eval_final")
    acc16, acc16_sd = ms("eval_final_bf16")
    init, _ = ms("eval_initial")
    init16, _ = ms("eval_initial_bf16")
    base = groups.get((L, BASELINE), [])
    paired = {}
    for key in ("eval_final_bf16", "eval_final"):
      mine, theirs = _by_seed(rs, key), _by_seed(base, key)
      seeds = sorted(set(mine) & set(theirs))
      paired[key] = paired_interval([mine[s] - theirs[s] for s in seeds])
    gain = paired_interval([r["eval_final_bf16"] - r["eval_initial_bf16"] for r in rs])
    mean = lambda k: _nan_mean([r[k] for r in rs if r.get(k) is not None])
    out.append(
      dict(
        length=L,
        recipe=spec,
        n_seeds=len(rs),
        seeds=[r["seed"] for r in rs],
        max_new_tokens=rs[0]["max_new_tokens"],
        eval_initial=init,
        eval_initial_bf16=init16,
        eval_final=acc,
        eval_final_sd=acc_sd,
        eval_final_bf16=acc16,
        eval_final_bf16_sd=acc16_sd,
        gain_bf16=gain,
        vs_bf16=paired["eval_final_bf16"],
        vs_bf16_own=paired["eval_final"],
        steps_to_target=[r["steps_to_target"] for r in rs],
        n_diverged=sum(r["diverged"] for r in rs),
        diverged_why=sorted({w for r in rs for w in r["diverged_why"]}),
        abs_diff_mean=mean("abs_diff_mean"),
        abs_diff_mean_sd=_mean_spread([r["abs_diff_mean"] for r in rs])[1],
        abs_diff_max=float(np.max([r["abs_diff_max"] for r in rs])),
        seq_abs_sum_mean=mean("seq_abs_sum_mean"),
        seq_abs_sum_max=float(np.nanmax([r.get("seq_abs_sum_max", np.nan) for r in rs])),
        kl_k3=mean("kl_k3"),
        kl_k3_sd=_mean_spread([r["kl_k3"] for r in rs])[1],
        ratio_out_frac=mean("ratio_out_frac"),
        reward_last=mean("reward_last"),
        response_length=mean("response_length"),
        time_rollout=mean("time_rollout"),
        time_reward=mean("time_reward"),
        time_update=mean("time_update"),
        wall_s=_nan_mean([r["wall_s"] for r in rs if r.get("wall_s") is not None]),
      )
    )
  return out


def verdicts(
  rows: Sequence[dict],
  agg_rows: Sequence[dict],
  length: int,
  *,
  min_gain: float = MIN_GAIN,
  smallest_drop: float = SMALLEST_DROP,
) -> dict:
  """The study's verdicts at one length (module docstring): {"valid", "mechanism", "central",
  "why": {...}} with each value a short string."""
  agg = {a["recipe"]: a for a in agg_rows if a["length"] == length}
  runs = [r for r in rows if r["length"] == length]
  why = {}
  base, off, jet = agg.get(BASELINE), agg.get("fp8_rollout"), agg.get("jet")
  if base is None or base["gain_bf16"]["n"] < 2:
    valid = "not judged"
    why["valid"] = "needs bf16 runs of at least two seeds"
  else:
    g = base["gain_bf16"]
    ok = g["mean"] >= min_gain and g["lo"] > 0
    valid = "valid" if ok else "invalid: bf16 did not learn"
    why["valid"] = (
      f"bf16 gain {g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] "
      f"(needs >= {min_gain:+.2f} and an interval above 0)"
    )
  if off is None or jet is None:
    mechanism = "not judged"
    why["mechanism"] = "needs fp8_rollout and jet"
  else:
    by = lambda spec, k: {r["seed"]: r[k] for r in runs if r["recipe"] == spec}
    seeds = sorted(set(by("fp8_rollout", "kl_k3")) & set(by("jet", "kl_k3")))
    keys = ("abs_diff_mean", "seq_abs_sum_mean", "kl_k3")
    held = {k: all(by("fp8_rollout", k)[s] > by("jet", k)[s] for s in seeds) for k in keys}
    mechanism = "confirmed" if seeds and all(held.values()) else "not confirmed"
    why["mechanism"] = f"fp8_rollout above jet in every one of {len(seeds)} seeds: " + ", ".join(
      f"{k} {'yes' if v else 'no'}" for k, v in held.items()
    )
  if not valid.startswith("valid") or off is None:
    central = "not judged"
    why["central"] = "the study is not valid" if off is not None else "needs fp8_rollout"
  else:
    d = off["vs_bf16"]
    j = jet["vs_bf16"] if jet is not None else None
    jet_ok = j is not None and not j["hi"] < 0
    if d["hi"] < 0 and jet_ok:
      central = "confirmed"
    elif d["lo"] > -smallest_drop:
      central = "refuted at this scale"
    else:
      central = "inconclusive"
    why["central"] = (
      f"fp8_rollout − bf16 {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
      + (f"; jet − bf16 {j['mean']:+.3f} [{j['lo']:+.3f}, {j['hi']:+.3f}]" if j else "")
      + f"; refuted needs the fp8_rollout interval above {-smallest_drop:+.2f}"
    )
  return dict(valid=valid, mechanism=mechanism, central=central, why=why)


ACCURACY_HEADER = (
  "| recipe | seeds | acc @0 own / bf16 | final acc own | final acc bf16-scored | "
  "gain (bf16-scored) [95% CI] | − bf16, bf16-scored [95% CI], p | − bf16, own [95% CI] | "
  "diverged |"
)
MISMATCH_HEADER = (
  "| recipe | mean \\|Δlog p\\| | max \\|Δlog p\\| | mean \\|ΣΔlog p\\| per seq. | "
  "max \\|ΣΔlog p\\| | k3 KL | tokens outside [0.8, 1.2] | resp. len | "
  "rollout s/step | update s/step | wall s/run |"
)
TABLE_HEADER = ACCURACY_HEADER


def _fmt(x, spec=".3f"):
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  return format(x, spec)


def _ci(c: dict, p: bool = False) -> str:
  if c["n"] == 0:
    return "–"
  if c["n"] < 2:
    return f"{c['mean']:+.3f}"
  out = f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"
  return out + (f", p={c['p']:.2g}" if p else "")


def _pm(mean, sd, n):
  return _fmt(mean) + (f" ± {sd:.3f}" if n > 1 and sd == sd else "")


def _sep(header: str) -> str:
  return "|" + "---|" * header.count(" | ") + "---|"


def format_table(agg_rows: Sequence[dict], target: float = 0.5) -> str:
  """The accuracy table (mean ± sample std over seeds; paired intervals against bf16)."""
  del target
  lines = [ACCURACY_HEADER, _sep(ACCURACY_HEADER)]
  for a in agg_rows:
    div = f"{a['n_diverged']}/{a['n_seeds']}" + (
      f" ({', '.join(a['diverged_why'])})" if a["diverged_why"] else ""
    )
    base = a["recipe"] == BASELINE
    lines.append(
      f"| {a['recipe']} | {a['n_seeds']} | {_fmt(a['eval_initial'])} / "
      f"{_fmt(a['eval_initial_bf16'])} | {_pm(a['eval_final'], a['eval_final_sd'], a['n_seeds'])} "
      f"| {_pm(a['eval_final_bf16'], a['eval_final_bf16_sd'], a['n_seeds'])} | "
      f"{_ci(a['gain_bf16'])} | {'–' if base else _ci(a['vs_bf16'], p=True)} | "
      f"{'–' if base else _ci(a['vs_bf16_own'])} | {div} |"
    )
  return "\n".join(lines)


def format_mismatch_table(agg_rows: Sequence[dict]) -> str:
  """The rollout/training mismatch table (means over steps, then over seeds)."""
  lines = [MISMATCH_HEADER, _sep(MISMATCH_HEADER)]
  for a in agg_rows:
    lines.append(
      f"| {a['recipe']} | {_fmt(a['abs_diff_mean'], '.2e')} | {_fmt(a['abs_diff_max'], '.2f')} | "
      f"{_fmt(a['seq_abs_sum_mean'], '.2e')} | {_fmt(a['seq_abs_sum_max'], '.2f')} | "
      f"{_fmt(a['kl_k3'], '.2e')} | {_fmt(a['ratio_out_frac'], '.2e')} | "
      f"{_fmt(a['response_length'], '.1f')} | {_fmt(a['time_rollout'], '.2f')} | "
      f"{_fmt(a['time_update'], '.2f')} | {_fmt(a['wall_s'], '.0f')} |"
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
    + ", ".join(f"`{r}`" for r in cfg.recipes)
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
      f"{_fmt(sft_acc)}" + (f"; SFT time {timing[key]:.0f} s" if key in timing else ""),
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
