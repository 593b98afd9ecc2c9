"""The fourth round's analysis (docs/study/round4/prereg.md): its outcomes, rules and verdicts.

Rows are results.json rows (`jetrl.study.summary`) with one more key, "warm": the warm start's
seed. Outcomes of a run:
  primary    bf16-scored held-out accuracy averaged over the evaluations at steps 10, 20, 30
             (`prereg.secondary` of the third round)
  secondary  mean training reward over the last 10 RL steps (`prereg.primary` of the third)

A comparison pairs two arms' runs of the same (warm start, seed) and takes the two-sided 95%
Student t interval of the mean paired difference (`stats.paired_interval`). Its call, with the
margin m = 5 points:
  non-inferior   the interval's lower end is above -m (a drop of m or more is excluded)
  inferior       the interval's upper end is below -m (a drop of more than m is shown)
  inconclusive   otherwise
and, separately, "drop shown" when the upper end is below 0 and the (Holm-adjusted, where a
family is named) p-value is below 0.05.

Primary (one hypothesis, no correction): jet@same_forward - bf16@same_forward over every
(warm start, seed) pair all three primary arms finished. Generality: the same difference per
warm start (reported), and a one-way ANOVA of the paired differences across warm starts; the
answer "holds on each warm start" when no warm start's interval lies wholly below -m and the
ANOVA's p is at least 0.05. Secondary family (Holm over the two): jet - bf16@recompute (the
paper's baseline) and bf16 - bf16@recompute (the old log-probs' source under bf16).

Crossover (the exact trainer, rollouts of rising mismatch; one warm start): each of the three
FP8/bf16-rollout arms against the bitwise one (`jet_exact`), paired by seed, Holm over the
three; the mismatch effect is "shown" when the largest-mismatch arm (E5M2) shows a drop,
"excluded at these doses" when every arm is non-inferior, else "inconclusive". Each arm's mean
per-token |rollout - training log-prob| is reported beside its effect (the dose).

Length (exploratory power, rules as the primary): jet - bf16 and fp8_rollout - bf16 at length 20.

A part cut short is judged on whole units (`whole_units`): the (warm start, seed) pairs every
arm of the part finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats as _st

from jetrl.study.prereg import holm
from jetrl.study.prereg import primary as reward_last10
from jetrl.study.prereg import secondary as heldout_accuracy
from jetrl.study.stats import paired_interval

MARGIN = 0.05
ALPHA = 0.05
JET, BF16, BF16_RC = "jet", "bf16", "bf16@recompute"
PRIMARY_ARMS = (BF16, JET, BF16_RC)
EXACT = "jet_exact"
CROSSOVER_ARMS = (
  "jet_exact_train",
  "jet_exact_train_bf16_rollout",
  "jet_exact_train_e5m2_rollout",
)
LARGEST_DOSE = "jet_exact_train_e5m2_rollout"
LENGTH_ARMS = (JET, "fp8_rollout")

OUTCOMES = {"primary": heldout_accuracy, "secondary": reward_last10}


def call(interval: dict, margin: float = MARGIN, p: float | None = None) -> dict:
  """The interval with its non-inferiority call and whether a drop is shown (p: the adjusted
  p-value to use for "drop shown"; default the interval's own)."""
  p = interval["p"] if p is None else p
  if interval["lo"] > -margin:
    verdict = "non-inferior"
  elif interval["hi"] < -margin:
    verdict = "inferior"
  else:
    verdict = "inconclusive"
  return dict(interval, call=verdict, drop_shown=bool(interval["hi"] < 0 and p < ALPHA))


def whole_units(rows: Sequence[dict], arms: Sequence[str], length: int) -> list[tuple[int, int]]:
  """The (warm start, seed) pairs at `length` that every one of `arms` finished."""
  per_arm = {a: set() for a in arms}
  for r in rows:
    if r["length"] == length and r["recipe"] in per_arm:
      per_arm[r["recipe"]].add((int(r["warm"]), int(r["seed"])))
  return sorted(set.intersection(*per_arm.values())) if per_arm else []


def _values(rows, arm, length, units, outcome) -> dict:
  return {
    (int(r["warm"]), int(r["seed"])): outcome(r)
    for r in rows
    if r["recipe"] == arm and r["length"] == length and (int(r["warm"]), int(r["seed"])) in units
  }


def paired(rows, arm, base, length, units, outcome=heldout_accuracy) -> tuple[list, list]:
  """(units, arm - base differences) over `units`, in order."""
  a = _values(rows, arm, length, set(units), outcome)
  b = _values(rows, base, length, set(units), outcome)
  keys = sorted(set(a) & set(b))
  return keys, [a[k] - b[k] for k in keys]


def heterogeneity(keys: Sequence[tuple[int, int]], diffs: Sequence[float]) -> dict:
  """One-way ANOVA of the differences across warm starts: {"F", "p", "groups"}; p is None with
  fewer than two warm starts of two or more units each."""
  groups: dict[int, list] = {}
  for (w, _), d in zip(keys, diffs):
    groups.setdefault(w, []).append(d)
  usable = [np.asarray(g, float) for g in groups.values() if len(g) >= 2]
  if len(usable) < 2:
    return dict(F=None, p=None, groups=len(groups))
  if np.ptp(np.concatenate(usable)) == 0:  # every difference equal: no spread to compare
    return dict(F=0.0, p=1.0, groups=len(groups))
  res = _st.f_oneway(*usable)
  return dict(F=float(res.statistic), p=float(res.pvalue), groups=len(groups))


def judge_primary(rows: Sequence[dict], length: int = 9, outcome_name: str = "primary") -> dict:
  """The primary comparison, its generality and the secondary family, for one outcome."""
  outcome = OUTCOMES[outcome_name]
  units = whole_units(rows, PRIMARY_ARMS, length)
  if len(units) < 2:
    return dict(units=units, primary=None, note="fewer than 2 whole (warm start, seed) units")
  keys, d = paired(rows, JET, BF16, length, units, outcome)
  main = call(paired_interval(d))
  per_warm = {}
  for w in sorted({k[0] for k in keys}):
    dw = [x for k, x in zip(keys, d) if k[0] == w]
    per_warm[w] = call(paired_interval(dw)) if len(dw) >= 2 else dict(n=len(dw))
  het = heterogeneity(keys, d)
  below = [w for w, v in per_warm.items() if "hi" in v and v["hi"] < -MARGIN]
  holds = main["call"] == "non-inferior" and not below and (het["p"] is None or het["p"] >= ALPHA)
  fam = {}
  for name, (a, b) in {
    "jet - bf16@recompute": (JET, BF16_RC),
    "bf16 - bf16@recompute": (BF16, BF16_RC),
  }.items():
    _, dd = paired(rows, a, b, length, units, outcome)
    fam[name] = paired_interval(dd)
  adj = holm({k: v["p"] for k, v in fam.items()})
  fam = {k: dict(call(v, p=adj[k]), p_holm=adj[k]) for k, v in fam.items()}
  return dict(
    units=[list(u) for u in units],
    primary=main,
    per_warm_start={str(w): v for w, v in per_warm.items()},
    heterogeneity=het,
    holds_on_each_warm_start=bool(holds),
    warm_starts_below_margin=below,
    secondary_family=fam,
  )


def judge_crossover(rows: Sequence[dict], length: int = 9, outcome_name: str = "primary") -> dict:
  """Each rollout against the bitwise one under the exact trainer, Holm over the three; the
  dose (mean per-token |delta log p|) of every arm; the mismatch verdict."""
  outcome = OUTCOMES[outcome_name]
  units = whole_units(rows, (EXACT, *CROSSOVER_ARMS), length)
  if len(units) < 2:
    return dict(units=units, arms={}, verdict=None, note="fewer than 2 whole seeds")
  arms = {}
  for a in CROSSOVER_ARMS:
    _, d = paired(rows, a, EXACT, length, units, outcome)
    arms[a] = paired_interval(d)
  adj = holm({a: v["p"] for a, v in arms.items()})
  arms = {a: dict(call(v, p=adj[a]), p_holm=adj[a]) for a, v in arms.items()}
  dose = {}
  for a in (EXACT, *CROSSOVER_ARMS):
    vals = [
      float(r["abs_diff_mean"])
      for r in rows
      if r["recipe"] == a
      and r["length"] == length
      and (int(r["warm"]), int(r["seed"])) in set(units)
    ]
    dose[a] = float(np.mean(vals)) if vals else None
  if arms[LARGEST_DOSE]["drop_shown"]:
    verdict = "mismatch effect shown"
  elif all(v["call"] == "non-inferior" for v in arms.values()):
    verdict = "no mismatch effect of 5 points or more at these doses"
  else:
    verdict = "inconclusive"
  return dict(units=[list(u) for u in units], arms=arms, dose=dose, verdict=verdict)


def judge_length(rows: Sequence[dict], length: int = 20, outcome_name: str = "primary") -> dict:
  """jet and fp8_rollout against bf16 at `length` (no correction: two reported comparisons)."""
  outcome = OUTCOMES[outcome_name]
  units = whole_units(rows, (BF16, *LENGTH_ARMS), length)
  if len(units) < 2:
    return dict(units=units, arms={}, note="fewer than 2 whole seeds")
  arms = {}
  for a in LENGTH_ARMS:
    _, d = paired(rows, a, BF16, length, units, outcome)
    arms[a] = call(paired_interval(d))
  return dict(units=[list(u) for u in units], arms=arms)


def judge_smollm2(rows: Sequence[dict]) -> dict:
  """rows: {"recipe", "seed", "before", "after"} per SmolLM2 run. Per recipe: the gain's
  interval over its seeds; per FP8 recipe: the paired difference of gains against bf16."""
  by: dict[str, dict[int, dict]] = {}
  for r in rows:
    by.setdefault(r["recipe"], {})[int(r["seed"])] = r
  gains = {}
  for recipe, runs in by.items():
    g = [runs[s]["after"] - runs[s]["before"] for s in sorted(runs)]
    gains[recipe] = paired_interval(g) if len(g) >= 2 else dict(n=len(g), mean=float(np.mean(g)))
  diffs = {}
  base = by.get(BF16, {})
  for recipe in (JET, "fp8_rollout"):
    mine = by.get(recipe, {})
    seeds = sorted(set(mine) & set(base))
    if len(seeds) >= 2:
      d = [
        (mine[s]["after"] - mine[s]["before"]) - (base[s]["after"] - base[s]["before"])
        for s in seeds
      ]
      diffs[recipe] = paired_interval(d)
  return dict(gain=gains, against_bf16=diffs)
