"""Power of the study's paired comparisons: how many seeds a given effect needs.

A paired comparison over n seeds takes the per-seed difference d_s (recipe minus bf16, same
seed) with sample mean m and sd s, and its two-sided 95% Student t interval
m +- t_{0.975, n-1} s / sqrt(n). With a true mean difference delta and a true sd sigma of d_s,
the statistic (m - x) / (s / sqrt(n)) has a noncentral t distribution with n - 1 degrees of
freedom and noncentrality (delta - x) sqrt(n) / sigma, which gives exactly:

  paired_power(delta, sigma, n)        P(the interval excludes 0): the t test detects delta
  prob_interval_above(x, delta, sigma, n)
                                       P(the interval's lower end is above x): the chance that
                                       the rule "refuted at this scale: lower end above
                                       -margin" fires, e.g. at delta = 0 (a true zero effect)
  seeds_for_power(delta, sigma, power) the smallest n whose paired_power reaches `power`
  paired_sd(a, b)                      the sd over seeds of a - b (the input sigma)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from scipy import stats as _st

ALPHA = 0.05


def _check(sigma: float, n: int) -> None:
  if not sigma > 0 or not math.isfinite(sigma):
    raise ValueError(f"sigma must be a finite sd > 0, got {sigma!r}")
  if int(n) != n or n < 2:
    raise ValueError(f"n must be an integer >= 2 (seeds), got {n!r}")


def _t_crit(n: int, alpha: float = ALPHA) -> float:
  return float(_st.t.ppf(1 - alpha / 2, n - 1))


def prob_interval_above(x: float, delta: float, sigma: float, n: int, alpha=ALPHA) -> float:
  """P(m - t_crit s / sqrt(n) > x) when the paired differences have mean delta, sd sigma."""
  _check(sigma, n)
  ncp = (delta - x) * math.sqrt(n) / sigma
  return float(_st.nct.sf(_t_crit(n, alpha), n - 1, ncp))


def paired_power(delta: float, sigma: float, n: int, alpha: float = ALPHA) -> float:
  """P(the two-sided paired t test at level alpha rejects 0) for a true mean delta."""
  _check(sigma, n)
  ncp = delta * math.sqrt(n) / sigma
  c = _t_crit(n, alpha)
  return float(_st.nct.sf(c, n - 1, ncp) + _st.nct.cdf(-c, n - 1, ncp))


def seeds_for_power(
  delta: float, sigma: float, power: float = 0.8, alpha: float = ALPHA, most: int = 10_000
) -> int:
  """The smallest number of seeds n >= 2 whose paired_power reaches `power`."""
  if not 0 < power < 1:
    raise ValueError(f"power must be in (0, 1), got {power!r}")
  if delta == 0:
    raise ValueError("delta must be nonzero: no number of seeds detects a zero effect")
  for n in range(2, most + 1):
    if paired_power(delta, sigma, n, alpha) >= power:
      return n
  raise ValueError(f"more than {most} seeds needed for delta={delta}, sigma={sigma}")


def paired_sd(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, int]:
  """(sd over the seeds both have of a[s] - b[s], that number of seeds); ddof 1."""
  seeds = sorted(set(a) & set(b))
  if len(seeds) < 2:
    raise ValueError(f"paired_sd needs two seeds in common, got {seeds}")
  d = np.array([a[s] - b[s] for s in seeds], np.float64)
  return float(d.std(ddof=1)), len(seeds)
