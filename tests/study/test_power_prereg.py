"""Power of paired t comparisons against published values and a simulation; the pre-registered
rules on hand-made rows."""

import numpy as np
import pytest

from jetrl.study import power, prereg


def test_paired_power_matches_published_values():
  # One-sample (paired) t test, two-sided alpha 0.05: d = 1 at n = 10 has power 0.803, and
  # d = 0.5 needs n = 34 for 80% (Cohen 1988; G*Power gives the same).
  assert power.paired_power(1.0, 1.0, 10) == pytest.approx(0.8031, abs=2e-4)
  assert power.seeds_for_power(0.5, 1.0, 0.8) == 34
  assert power.seeds_for_power(0.05, 0.044) == 9  # the study's 5 points at its paired sd


def test_interval_above_by_simulation():
  rng = np.random.default_rng(0)
  n, sigma, x = 10, 0.044, -0.05
  from scipy import stats

  d = rng.normal(0.0, sigma, (200_000, n))
  lo = d.mean(1) - stats.t.ppf(0.975, n - 1) * d.std(1, ddof=1) / np.sqrt(n)
  assert power.prob_interval_above(x, 0.0, sigma, n) == pytest.approx((lo > x).mean(), abs=4e-3)
  # At a true effect equal to the bound, the lower end exceeds it 2.5% of the time.
  assert power.prob_interval_above(x, x, sigma, n) == pytest.approx(0.025, abs=1e-9)


def test_power_errors():
  with pytest.raises(ValueError, match="sigma"):
    power.paired_power(0.1, 0.0, 5)
  with pytest.raises(ValueError, match="integer >= 2"):
    power.paired_power(0.1, 1.0, 1)
  with pytest.raises(ValueError, match="nonzero"):
    power.seeds_for_power(0.0, 1.0)
  with pytest.raises(ValueError, match="two seeds"):
    power.paired_sd({0: 1.0}, {0: 2.0})
  sd, n = power.paired_sd({0: 1.0, 1: 3.0, 2: 0.0}, {0: 0.0, 1: 1.0, 5: 9.0})
  assert n == 2 and sd == pytest.approx(np.std([1.0, 2.0], ddof=1))


def test_holm_by_hand():
  adj = prereg.holm({"a": 0.01, "b": 0.04, "c": 0.03})
  # sorted 0.01, 0.03, 0.04 -> 3 * 0.01, max(0.03, 2 * 0.03), max(0.06, 1 * 0.04)
  assert adj == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})


def _row(recipe, seed, reward, evals=(0.3, 0.4, 0.5)):
  return dict(
    length=9,
    recipe=recipe,
    seed=seed,
    reward_series=[0.0] * 20 + [reward] * 10,
    eval_steps=[0, 10, 20, 30],
    eval_accuracy_bf16=[0.2, *evals],
  )


def test_outcomes_by_hand():
  r = _row("bf16", 0, 0.5)
  r["reward_series"] = list(range(30))
  assert prereg.primary(r) == pytest.approx(np.mean(range(20, 30)))
  assert prereg.secondary(r) == pytest.approx(0.4)
  with pytest.raises(ValueError, match="needs the last 10"):
    prereg.primary(dict(r, reward_series=[1.0] * 5))
  with pytest.raises(ValueError, match="eval.every"):
    prereg.secondary(dict(r, eval_steps=[0, 30], eval_accuracy_bf16=[0.1, 0.2]))


def test_attribution_follows_the_training_step():
  rng = np.random.default_rng(1)
  rows = []
  shift = {
    "fp8_rollout": 0.0,
    "jet": -0.10,
    "jet_exact": 0.0,
    "jet_exact_rollout": -0.10,
    "jet_exact_train": 0.0,
  }
  for s in range(10):
    base = 0.4 + 0.05 * rng.standard_normal()
    rows.append(_row("bf16", s, base))
    for arm, d in shift.items():
      rows.append(_row(arm, s, base + d + 0.01 * rng.standard_normal()))
  out = prereg.judge(rows, 9)
  assert out["arms"]["jet"]["call"] == "drop"
  assert out["arms"]["jet_exact_rollout"]["call"] == "drop"
  assert out["arms"]["jet_exact_train"]["call"] == "no drop"
  assert out["attribution"] == "training arithmetic"
  # Swap which half carries the drop: the rollout's.
  for r in rows:
    if r["recipe"] in ("jet_exact_rollout", "jet_exact_train"):
      r["recipe"] = {
        "jet_exact_rollout": "jet_exact_train",
        "jet_exact_train": "jet_exact_rollout",
      }[r["recipe"]]
  assert prereg.judge(rows, 9)["attribution"] == "mismatch"
  # A wide spread: neither call can be made.
  wide = [
    dict(r, reward_series=[0.0] * 20 + [r["reward_series"][-1] + 0.3 * rng.standard_normal()] * 10)
    for r in rows
  ]
  assert prereg.judge(wide, 9)["arms"]["jet"]["call"] == "inconclusive"


def test_a_test_cut_short_is_judged_on_its_whole_seeds():
  # Seeds 0-2 for every arm; seed 3 for bf16 and jet only (cut in the middle of seed 3); an
  # exploratory arm at seed 4 does not count. jet is 10 points low at seeds 0-2 and 50 points
  # high at seed 3: judged on the whole seeds, the mean is the -10 points of seeds 0-2.
  rows = []
  for s in range(3):
    rows.append(_row("bf16", s, 0.4 + 0.01 * s))
    rows.append(_row("jet", s, 0.3 + 0.01 * s + 0.001 * s))
    rows.append(_row("jet_exact", s, 0.4 + 0.01 * s))
  rows += [_row("bf16", 3, 0.4), _row("jet", 3, 0.9), _row("fp8_rollout_e5m2", 4, 0.1)]
  assert prereg.whole_seeds(rows, 9) == [0, 1, 2]
  assert prereg.whole_seeds(rows, 3) == []
  out = prereg.judge(rows, 9)
  assert out["seeds"] == [0, 1, 2]
  assert out["arms"]["jet"]["n"] == 3
  assert out["arms"]["jet"]["mean"] == pytest.approx(-0.10 + 0.001)  # mean of 0.001 s, s=0..2


def test_crossover_contrasts_by_hand():
  # Seed s: jet 0.30, jet_exact_rollout 0.34, jet_exact_train 0.42, jet_exact 0.40 (+0.01 s
  # each, + 0.02 s on jet alone). Per seed, by hand: training step (0.30 + 0.34)/2 - (0.42 +
  # 0.40)/2 = -0.09 (+0.01 s); rollout (0.30 + 0.42)/2 - (0.34 + 0.40)/2 = -0.01 (+0.01 s);
  # interaction (0.30 - 0.34) - (0.42 - 0.40) = -0.06 (+0.02 s). A seed missing one cell
  # (seed 3) is not a whole seed and does not count.
  rows = []
  for s in range(3):
    rows += [
      _row("bf16", s, 0.4),
      _row("fp8_rollout", s, 0.4),
      _row("jet", s, 0.30 + 0.01 * s + 0.02 * s),
      _row("jet_exact_rollout", s, 0.34 + 0.01 * s),
      _row("jet_exact_train", s, 0.42 + 0.01 * s),
      _row("jet_exact", s, 0.40 + 0.01 * s),
    ]
  rows += [_row("bf16", 3, 0.4), _row("jet", 3, 0.9), _row("jet_exact", 3, 0.1)]
  out = prereg.crossover_contrasts(rows, 9)
  want = {"training": -0.09, "rollout": -0.01, "interaction": -0.06}
  step = {"training": 0.01, "rollout": 0.01, "interaction": 0.02}
  for k in want:
    assert out[k]["seeds"] == [0, 1, 2]
    assert out[k]["per_seed"] == pytest.approx([want[k] + step[k] * s for s in range(3)])
    assert out[k]["mean"] == pytest.approx(want[k] + step[k])
  # An arm of the crossover with no run: nothing to contrast.
  assert prereg.crossover_contrasts([r for r in rows if r["recipe"] != "jet_exact"], 9) == {}
  # Only some of the whole seeds (those not seen when a contrast was chosen): seeds 1 and 2.
  part = prereg.crossover_contrasts(rows, 9, seeds=[1, 2, 3])
  assert part["training"]["seeds"] == [1, 2]
  assert part["training"]["mean"] == pytest.approx(-0.09 + 0.01 * 1.5)
  assert prereg.crossover_contrasts(rows, 9, seeds=[2, 3]) == {}  # one seed: no interval
