"""The study's statistics: means and spreads over seeds, paired comparisons with bf16, and the
verdicts.

Paired comparisons. Every arm runs the same seeds from the same warm start, so seed s of an
arm and seed s of bf16 share their warm start, their problems and their evaluation set. The
difference of an arm's final accuracy from bf16's is taken per seed, and its mean gets a
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

Rows are keyed by their arm's label (`recipe`: bf16, fp8_rollout, fp8_rollout+tis, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BASELINE = "bf16"
MIN_GAIN = 0.10
SMALLEST_DROP = 0.03


def nan_mean(xs) -> float:
  """The mean of `xs`, NaN when empty."""
  return float(np.mean(xs)) if len(xs) else float("nan")


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


def _paired(rs: Sequence[dict], base: Sequence[dict], key: str) -> dict:
  """The paired interval of `key` in `rs` minus `base`, over the seeds both have."""
  mine, theirs = _by_seed(rs, key), _by_seed(base, key)
  return paired_interval([mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))])


# Means over the seeds of a (length, arm), each of the runs' value of that name.
MEANS = (
  "ratio_out_frac",
  "reward_last",
  "response_length",
  "time_rollout",
  "time_reward",
  "time_update",
  "wall_s",
)


def aggregate(rows: Sequence[dict]) -> list[dict]:
  """Rows grouped by (length, arm) over seeds, in first-seen order, with paired comparisons
  against bf16's runs of the same length and seeds."""
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["length"], r["recipe"]), []).append(r)
  out = []
  for (L, label), rs in groups.items():
    spread = lambda k: _mean_spread([r.get(k) for r in rs])
    mean = lambda k: nan_mean([r[k] for r in rs if r.get(k) is not None])
    base = groups.get((L, BASELINE), [])
    a = dict(length=L, recipe=label, n_seeds=len(rs), seeds=[r["seed"] for r in rs])
    a["max_new_tokens"] = rs[0]["max_new_tokens"]
    for key in ("eval_initial", "eval_initial_bf16"):
      a[key] = spread(key)[0]
    for key in ("eval_final", "eval_final_bf16"):
      a[key], a[key + "_sd"] = spread(key)
    a["gain_bf16"] = paired_interval([r["eval_final_bf16"] - r["eval_initial_bf16"] for r in rs])
    a["vs_bf16"], a["vs_bf16_own"] = (
      _paired(rs, base, k) for k in ("eval_final_bf16", "eval_final")
    )
    a["steps_to_target"] = [r["steps_to_target"] for r in rs]
    a["n_diverged"] = sum(r["diverged"] for r in rs)
    a["diverged_why"] = sorted({w for r in rs for w in r["diverged_why"]})
    a.update(
      abs_diff_mean=mean("abs_diff_mean"),
      abs_diff_mean_sd=spread("abs_diff_mean")[1],
      abs_diff_max=float(np.max([r["abs_diff_max"] for r in rs])),
      seq_abs_sum_mean=mean("seq_abs_sum_mean"),
      seq_abs_sum_max=float(np.nanmax([r.get("seq_abs_sum_max", np.nan) for r in rs])),
      kl_k3=mean("kl_k3"),
      kl_k3_sd=spread("kl_k3")[1],
    )
    a.update({k: mean(k) for k in MEANS})
    out.append(a)
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
