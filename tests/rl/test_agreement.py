"""Tests for jetrl.rl.agreement against float64 numpy references and hand-computed values."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.rl import agreement

agreement_metrics = jax.jit(agreement.agreement_metrics, static_argnames=("bin_edges", "log_clamp"))
position_bins = jax.jit(agreement.position_bins, static_argnames=("bin_edges", "num_bins"))

EDGES = (0, 2, 3, 8)


def np_metrics(roll, train, mask, edges, log_clamp=20.0):
  rows = [
    abs(sum(float(train[b, t]) - float(roll[b, t]) for t in range(mask.shape[1]) if mask[b, t]))
    for b in range(mask.shape[0])
    if mask[b].any()
  ]
  roll = roll.astype(np.float64)[mask]
  train = train.astype(np.float64)[mask]
  d = train - roll
  dc = np.clip(d, -log_clamp, log_clamp)
  out = {
    "abs_diff_mean": np.abs(d).mean(),
    "abs_diff_max": np.abs(d).max(),
    "kl_k3": (np.exp(dc) - 1 - dc).mean(),
    "prob_ratio_error": np.exp(np.abs(dc)).mean(),
    "prob_pearson": np.corrcoef(np.exp(roll), np.exp(train))[0, 1],
    "ratio_out_frac": np.mean((np.exp(d) < 0.8) | (np.exp(d) > 1.2)),
    "seq_abs_sum_mean": np.mean(rows),
    "seq_abs_sum_max": np.max(rows),
    "n_tokens": float(mask.sum()),
  }
  return out


def np_bins(values, mask, edges):
  """Per-bin mean and count by an explicit loop over tokens."""
  sums = [0.0] * len(edges)
  counts = [0] * len(edges)
  b_rows, t_cols = values.shape
  for b in range(b_rows):
    for t in range(t_cols):
      if not mask[b, t]:
        continue
      i = max(k for k, e in enumerate(edges) if e <= t)
      sums[i] += float(values[b, t])
      counts[i] += 1
  means = [s / c if c else 0.0 for s, c in zip(sums, counts)]
  return np.array(means), np.array(counts, np.float64)


def random_batch(seed, shape=(5, 12), noise=0.3):
  rng = np.random.default_rng(seed)
  roll = np.log(rng.uniform(0.01, 1.0, shape)).astype(np.float32)
  train = np.minimum(roll + rng.normal(0.0, noise, shape), 0.0).astype(np.float32)
  mask = rng.random(shape) < 0.75
  mask[:, 0] = True
  return roll, train, mask


def check_against_numpy(roll, train, mask, edges):
  out = agreement_metrics(roll, train, mask, bin_edges=edges)
  ref = np_metrics(roll, train, mask, edges)
  for key, value in ref.items():
    assert out[key].dtype == np.float32 and out[key].shape == ()
    np.testing.assert_allclose(out[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
  ref_mean, ref_count = np_bins(np.abs(train.astype(np.float64) - roll), mask, edges)
  np.testing.assert_allclose(out["bin_abs_diff_mean"], ref_mean, rtol=2e-5, atol=1e-6)
  np.testing.assert_array_equal(out["bin_count"], ref_count)
  assert float(np.sum(out["bin_count"])) == mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_numpy(seed):
  check_against_numpy(*random_batch(seed), EDGES)


def test_default_edges_and_many_bins():
  roll, train, mask = random_batch(7, shape=(3, 40))
  check_against_numpy(roll, train, mask, agreement.DEFAULT_EDGES)
  out = agreement_metrics(roll, train, mask)
  assert out["bin_count"].shape == (len(agreement.DEFAULT_EDGES),)
  # Bins past T are empty: count 0 and mean 0.
  assert np.all(np.asarray(out["bin_count"])[4:] == 0)
  assert np.all(np.asarray(out["bin_abs_diff_mean"])[4:] == 0)


def test_identical_logprobs_are_perfect_agreement():
  roll, _, mask = random_batch(3)
  out = agreement_metrics(roll, roll, mask, bin_edges=EDGES)
  assert float(out["abs_diff_mean"]) == 0.0 and float(out["abs_diff_max"]) == 0.0
  assert float(out["kl_k3"]) == 0.0
  assert float(out["prob_ratio_error"]) == 1.0
  np.testing.assert_allclose(out["prob_pearson"], 1.0, rtol=1e-6)
  assert np.all(np.asarray(out["bin_abs_diff_mean"]) == 0.0)


def test_hand_values():
  # Two tokens: Δ = log 2 and Δ = 0.
  roll = np.array([[-1.0, -0.5]], np.float32)
  train = np.array([[-1.0 + math.log(2.0), -0.5]], np.float32)
  out = agreement_metrics(roll, train, np.ones((1, 2), bool), bin_edges=(0, 1))
  np.testing.assert_allclose(out["abs_diff_mean"], math.log(2.0) / 2, rtol=1e-6)
  np.testing.assert_allclose(out["abs_diff_max"], math.log(2.0), rtol=1e-6)
  np.testing.assert_allclose(out["kl_k3"], (2 - 1 - math.log(2.0)) / 2, rtol=1e-5)
  np.testing.assert_allclose(out["prob_ratio_error"], (2 + 1) / 2, rtol=1e-6)
  # Two points: probabilities (0.37, 0.61) vs (0.74, 0.61) move in opposite directions.
  np.testing.assert_allclose(out["prob_pearson"], -1.0, rtol=1e-6)
  np.testing.assert_allclose(out["bin_abs_diff_mean"], [math.log(2.0), 0.0], atol=1e-6)
  np.testing.assert_array_equal(out["bin_count"], [1, 1])
  assert float(out["ratio_out_frac"]) == 0.5  # ratio 2 is outside [0.8, 1.2], ratio 1 inside
  np.testing.assert_allclose(out["seq_abs_sum_mean"], math.log(2.0), rtol=1e-6)


def test_sequence_log_ratio_is_the_sum_not_the_sum_of_magnitudes():
  # Row 0: Δ = +0.3, -0.3, +0.1 -> |Σ Δ| = 0.1 (Σ |Δ| would be 0.7); row 1: Δ = -0.2, -0.2
  # and a masked position holding garbage -> 0.4; row 2: no tokens (left out of the mean).
  roll = np.full((3, 3), -1.0, np.float32)
  train = roll + np.array([[0.3, -0.3, 0.1], [-0.2, -0.2, 9.0], [5.0, 5.0, 5.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
  out = agreement_metrics(roll, train, mask, bin_edges=(0,))
  np.testing.assert_allclose(out["seq_abs_sum_mean"], (0.1 + 0.4) / 2, atol=1e-6)
  np.testing.assert_allclose(out["seq_abs_sum_max"], 0.4, atol=1e-6)
  # exp(±0.3) = 1.35 / 0.74 and exp(-0.2) = 0.82, exp(0.1) = 1.11: two of five tokens outside.
  np.testing.assert_allclose(out["ratio_out_frac"], 2 / 5, rtol=1e-6)


def test_zero_variance_pearson_is_safe():
  mask = np.ones((2, 3), bool)
  const = np.full((2, 3), -0.7, np.float32)
  out = agreement_metrics(const, const, mask, bin_edges=EDGES)
  assert float(out["prob_pearson"]) == 1.0
  out = agreement_metrics(const, const - 0.1, mask, bin_edges=EDGES)
  assert float(out["prob_pearson"]) == 0.0
  varied = const + np.arange(6, dtype=np.float32).reshape(2, 3) * -0.1
  out = agreement_metrics(const, varied, mask, bin_edges=EDGES)
  assert float(out["prob_pearson"]) == 0.0
  # A single token.
  one = np.zeros((2, 3), bool)
  one[1, 2] = True
  out = agreement_metrics(const, varied, one, bin_edges=EDGES)
  assert float(out["prob_pearson"]) == 0.0 and float(out["n_tokens"]) == 1.0
  # No tokens at all: everything finite, zero counts.
  out = agreement_metrics(const, varied, np.zeros((2, 3), bool), bin_edges=EDGES)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in out.values())
  assert float(out["n_tokens"]) == 0.0 and float(out["abs_diff_max"]) == 0.0


def test_extreme_gaps_stay_finite_and_nan_shows():
  roll, train, mask = random_batch(4)
  train = train.copy()
  train[0, 0], train[1, 0] = roll[0, 0] + 50.0, roll[1, 0] - 50.0
  train[~mask] = np.nan  # garbage at masked positions must not leak
  out = agreement_metrics(roll, train, mask, bin_edges=EDGES)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in out.values())
  np.testing.assert_allclose(out["abs_diff_max"], 50.0, rtol=1e-5)
  train[0, 0] = np.nan
  out = agreement_metrics(roll, train, mask, bin_edges=EDGES)
  for key in (
    "abs_diff_mean",
    "abs_diff_max",
    "kl_k3",
    "prob_ratio_error",
    "prob_pearson",
    "ratio_out_frac",
    "seq_abs_sum_mean",
    "seq_abs_sum_max",
  ):
    assert np.isnan(float(out[key])), key


def test_k3_estimates_kl_rollout_to_train():
  # Tokens sampled from the rollout distribution q; the estimate targets KL(q || p_train),
  # which differs clearly from the reverse direction for these two distributions.
  q = np.array([0.85, 0.1, 0.04, 0.01])
  p = np.array([0.4, 0.3, 0.2, 0.1])
  kl_qp = float(np.sum(q * np.log(q / p)))
  kl_pq = float(np.sum(p * np.log(p / q)))
  assert abs(kl_qp - kl_pq) > 0.05
  tokens = np.random.default_rng(5).choice(4, size=(64, 2048), p=q)
  roll = np.log(q)[tokens].astype(np.float32)
  train = np.log(p)[tokens].astype(np.float32)
  out = agreement_metrics(roll, train, np.ones(tokens.shape, bool), bin_edges=(0,))
  np.testing.assert_allclose(out["kl_k3"], kl_qp, atol=0.01)


def test_position_bins_num_bins_and_validation():
  rng = np.random.default_rng(6)
  values = rng.random((3, 10)).astype(np.float32)
  mask = rng.random((3, 10)) < 0.8
  mean, count = position_bins(values, mask, num_bins=3)
  edges = agreement.equal_width_edges(3, 10)
  assert edges == (0, 4, 8)
  ref_mean, ref_count = np_bins(values, mask, edges)
  np.testing.assert_allclose(mean, ref_mean, rtol=1e-6)
  np.testing.assert_array_equal(count, ref_count)
  with pytest.raises(ValueError, match="exactly one"):
    agreement.position_bins(values, mask)
  with pytest.raises(ValueError, match="exactly one"):
    agreement.position_bins(values, mask, bin_edges=(0, 4), num_bins=2)
  for bad in [(1, 4), (0, 4, 4), (0, 8, 4), ()]:
    with pytest.raises(ValueError, match="strictly increasing"):
      agreement.position_bins(values, mask, bin_edges=bad)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.sampled_from([0.0, 1e-3, 0.5, 5.0]))
def test_property_random_batches_match_numpy(seed, noise):
  roll, train, mask = random_batch(seed, noise=noise)
  if noise == 0.0:
    out = agreement_metrics(roll, train, mask, bin_edges=EDGES)
    assert float(out["abs_diff_max"]) == 0.0
    return
  check_against_numpy(roll, train, mask, EDGES)
