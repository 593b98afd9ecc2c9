"""The pre-registered learning test of docs/study/prereg_round3.md: its outcomes and its rules.

Outcomes per run (a row of results.json, `jetrl.study.summary`):
  primary    the mean training reward over the last `last_steps` (10) RL steps
  secondary  the bf16-scored held-out accuracy averaged over the last `last_evals` (3)
             evaluations (the run needs --eval.every so that there are that many after step 0)

Per arm against bf16 (paired by seed, `stats.paired_interval`, 95% t interval):
  drop          the interval lies below 0 and the Holm-corrected p-value over the compared
                arms is below 0.05
  no drop       the interval's lower end is above -margin (5 points): a drop of `margin` or
                more is excluded. With n seeds and a paired sd sigma, a true drop of exactly
                `margin` passes this with probability 2.5% and a true zero effect with
                `power.prob_interval_above(-margin, 0, sigma, n)` (0.89 at the planned n and sd)
  inconclusive  otherwise

Attribution (the 2 x 2 crossover; arms named by their recipe):
  training arithmetic  jet and jet_exact_rollout (jet's training step) both drop, and
                       jet_exact_train (jet's rollout, the exact training step) shows no drop
  mismatch             jet and jet_exact_train (jet's rollout) both drop, and
                       jet_exact_rollout (the bitwise rollout) shows no drop
  neither              jet shows no drop
  unresolved           anything else

A test cut short is judged on its whole seeds (`whole_seeds`): the seeds that every arm with
a finished run finished. The runs go in the order seed, then arm, so those are the seeds
before the cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jetrl.study.stats import BASELINE, paired_interval

MARGIN = 0.05
LAST_STEPS = 10
LAST_EVALS = 3
ALPHA = 0.05
ARMS = ("fp8_rollout", "jet", "jet_exact", "jet_exact_rollout", "jet_exact_train")


def primary(row: dict, last_steps: int = LAST_STEPS) -> float:
  """Mean training reward over the run's last `last_steps` steps."""
  series = row["reward_series"]
  if len(series) < last_steps:
    raise ValueError(
      f"run {row.get('recipe')}/seed{row.get('seed')} has {len(series)} steps; the primary "
      f"outcome needs the last {last_steps}"
    )
  return float(np.mean(series[-last_steps:]))


def secondary(row: dict, last_evals: int = LAST_EVALS) -> float:
  """bf16-scored held-out accuracy averaged over the run's last `last_evals` evaluations
  after step 0."""
  steps, acc = row["eval_steps"], row["eval_accuracy_bf16"]
  after = [a for s, a in zip(steps, acc) if s > 0]
  if len(after) < last_evals:
    raise ValueError(
      f"run {row.get('recipe')}/seed{row.get('seed')} has {len(after)} evaluations after "
      f"step 0; the secondary outcome needs {last_evals} (run with --eval.every)"
    )
  return float(np.mean(after[-last_evals:]))


def holm(pvalues: dict) -> dict:
  """Holm-Bonferroni adjusted p-values {name: p}, monotone, capped at 1."""
  order = sorted(pvalues, key=lambda k: pvalues[k])
  m, out, running = len(order), {}, 0.0
  for i, k in enumerate(order):
    running = max(running, min(1.0, (m - i) * pvalues[k]))
    out[k] = running
  return out


def whole_seeds(rows: Sequence[dict], length: int) -> list[int]:
  """The seeds at `length` that every arm of the test (bf16 and ARMS) with a finished run there
  has finished: a test cut short is judged on these. Rows of other recipes are ignored."""
  at = [r for r in rows if r["length"] == length and r["recipe"] in (BASELINE, *ARMS)]
  per_arm = {}
  for r in at:
    per_arm.setdefault(r["recipe"], set()).add(r["seed"])
  if not per_arm:
    return []
  return sorted(set.intersection(*per_arm.values()))


def judge(rows: Sequence[dict], length: int, outcome=primary, margin: float = MARGIN) -> dict:
  """{"arms": {arm: {interval..., "p_holm", "call"}}, "attribution": str, "seeds": [...]} at
  one length, on the whole seeds only (`whole_seeds`)."""
  whole = set(whole_seeds(rows, length))
  at = [r for r in rows if r["length"] == length and r["seed"] in whole]
  by = lambda arm: {r["seed"]: outcome(r) for r in at if r["recipe"] == arm}
  base = by(BASELINE)
  arms = {}
  for arm in ARMS:
    mine = by(arm)
    seeds = sorted(set(mine) & set(base))
    if len(seeds) >= 2:
      arms[arm] = paired_interval([mine[s] - base[s] for s in seeds])
  adj = holm({a: v["p"] for a, v in arms.items()})
  for a, v in arms.items():
    v["p_holm"] = adj[a]
    if v["hi"] < 0 and adj[a] < ALPHA:
      v["call"] = "drop"
    elif v["lo"] > -margin:
      v["call"] = "no drop"
    else:
      v["call"] = "inconclusive"
  call = lambda a: arms.get(a, {}).get("call")
  if call("jet") == "no drop":
    attribution = "neither"
  elif (
    call("jet") == "drop"
    and call("jet_exact_rollout") == "drop"
    and call("jet_exact_train") == "no drop"
  ):
    attribution = "training arithmetic"
  elif (
    call("jet") == "drop"
    and call("jet_exact_train") == "drop"
    and call("jet_exact_rollout") == "no drop"
  ):
    attribution = "mismatch"
  else:
    attribution = "unresolved"
  return dict(arms=arms, attribution=attribution, seeds=sorted(whole))


# The crossover's cells: (training step, rollout) -> arm.
CROSSOVER = {
  ("jet", "jet"): "jet",
  ("jet", "exact"): "jet_exact_rollout",
  ("exact", "jet"): "jet_exact_train",
  ("exact", "exact"): "jet_exact",
}


def crossover_contrasts(
  rows: Sequence[dict], length: int, outcome=primary, seeds: Sequence[int] | None = None
) -> dict:
  """The 2 x 2 crossover's contrasts within itself, paired by seed over the whole seeds: NOT a
  committed rule (docs/study/prereg_round3.md judges each arm against bf16 only); reported as
  post hoc. Per seed, with a = jet, b = jet_exact_rollout, c = jet_exact_train, d = jet_exact:
    "training": (a + b) / 2 - (c + d) / 2  (jet's training step - the exact one),
    "rollout":  (a + c) / 2 - (b + d) / 2  (jet's rollout - the bitwise one),
    "interaction": (a - b) - (c - d).
  Each is `paired_interval` over the seeds plus "per_seed"; {} when fewer than two seeds have
  every cell. `seeds`: only these of the whole seeds (e.g. those run after the contrast was
  chosen)."""
  whole = set(whole_seeds(rows, length))
  if seeds is not None:
    whole &= set(seeds)
  cell = {}
  for (train, roll), arm in CROSSOVER.items():
    cell[train, roll] = {
      r["seed"]: outcome(r)
      for r in rows
      if r["length"] == length and r["recipe"] == arm and r["seed"] in whole
    }
  seeds = sorted(set.intersection(*(set(v) for v in cell.values())))
  if len(seeds) < 2:
    return {}
  a, b = cell["jet", "jet"], cell["jet", "exact"]
  c, d = cell["exact", "jet"], cell["exact", "exact"]
  per = {
    "training": [(a[s] + b[s]) / 2 - (c[s] + d[s]) / 2 for s in seeds],
    "rollout": [(a[s] + c[s]) / 2 - (b[s] + d[s]) / 2 for s in seeds],
    "interaction": [(a[s] - b[s]) - (c[s] - d[s]) for s in seeds],
  }
  return {k: dict(paired_interval(v), per_seed=v, seeds=seeds) for k, v in per.items()}
