"""Tests for jetrl.rl.correction: hand-computed TIS / MIS weights and numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.rl import correction, losses

importance_weights = jax.jit(
  correction.importance_weights, static_argnames=("method", "cap", "cap_low", "log_clamp")
)

RATIOS = np.array([0.25, 0.5, 1.0, 3.0])


def ratio_batch(ratios, rollout=0.0):
  """One row whose token ratios train/rollout are `ratios`."""
  roll = np.full((1, len(ratios)), rollout, np.float32)
  train = (roll + np.log(np.asarray(ratios))[None]).astype(np.float32)
  return train, roll, np.ones_like(roll, bool)


def np_weights(train, roll, mask, method, cap, log_clamp=20.0, low=None):
  """(weights, frac_truncated, frac_dropped) in float64."""
  low = 1.0 / cap if low is None else low
  lr = np.where(mask, train.astype(np.float64) - roll.astype(np.float64), 0.0)
  if method == "none":
    w = np.ones_like(lr)
    trunc = drop = np.zeros_like(lr, bool)
  else:
    if method.startswith("seq_"):
      s = np.clip(lr.sum(axis=1, keepdims=True), -log_clamp, log_clamp)
      ratio = np.broadcast_to(np.exp(s), lr.shape)
    elif method == "geo_mis":
      n = np.maximum(mask.sum(axis=1, keepdims=True), 1)
      s = np.clip(lr.sum(axis=1, keepdims=True) / n, -log_clamp, log_clamp)
      ratio = np.broadcast_to(np.exp(s), lr.shape)
    else:
      ratio = np.exp(lr)
    if method.endswith("tis"):
      w, trunc, drop = np.minimum(ratio, cap), ratio > cap, np.zeros_like(lr, bool)
    else:
      keep = (ratio >= low) & (ratio <= cap)
      inside = ratio if method == "icepop" else 1.0
      w, trunc, drop = np.where(keep, inside, 0.0), np.zeros_like(lr, bool), ~keep
  n = max(mask.sum(), 1)
  return np.where(mask, w, 0.0), (trunc & mask).sum() / n, (drop & mask).sum() / n


def test_tis_hand_values():
  w, metrics = importance_weights(*ratio_batch(RATIOS), method="tis", cap=2.0)
  np.testing.assert_allclose(w[0], [0.25, 0.5, 1.0, 2.0], rtol=1e-6)
  assert float(metrics["frac_truncated"]) == 0.25
  assert float(metrics["frac_dropped"]) == 0.0
  np.testing.assert_allclose(metrics["mean_weight"], 3.75 / 4, rtol=1e-6)


def test_mis_hand_values():
  # Ratios 0.25 and 3 leave [1/2, 2] and are dropped; 0.5 sits on the boundary and is kept.
  w, metrics = importance_weights(*ratio_batch(RATIOS), method="mis", cap=2.0)
  np.testing.assert_array_equal(w[0], [0.0, 1.0, 1.0, 0.0])
  assert float(metrics["frac_dropped"]) == 0.5
  assert float(metrics["frac_truncated"]) == 0.0
  assert float(metrics["mean_weight"]) == 0.5
  # Away from the boundary the result does not depend on the rollout log-prob level.
  w2, _ = importance_weights(*ratio_batch([0.25, 0.6, 1.0, 3.0], rollout=-2.5), method="mis")
  np.testing.assert_array_equal(w2[0], [0.0, 1.0, 1.0, 0.0])


def test_sequence_level_hand_values():
  # Row 0: ratios 2, 3 -> product 6; row 1: 0.5, 0.5 -> 0.25; row 2: 3, 0.5 -> 1.5;
  # row 3: one token of ratio 1.5 and a masked position holding garbage.
  roll = np.full((4, 2), -1.0, np.float32)
  train = roll + np.log(np.array([[2.0, 3.0], [0.5, 0.5], [3.0, 0.5], [1.5, 1e30]]))
  train = train.astype(np.float32)
  mask = np.array([[1, 1], [1, 1], [1, 1], [1, 0]], bool)
  w, m = importance_weights(train, roll, mask, method="seq_tis", cap=2.0)
  np.testing.assert_allclose(w, [[2.0, 2.0], [0.25, 0.25], [1.5, 1.5], [1.5, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(m["frac_truncated"], 2 / 7, rtol=1e-6)
  w, m = importance_weights(train, roll, mask, method="seq_mis", cap=2.0)
  np.testing.assert_array_equal(w, [[0, 0], [0, 0], [1, 1], [1, 0]])
  np.testing.assert_allclose(m["frac_dropped"], 4 / 7, rtol=1e-6)
  np.testing.assert_allclose(m["mean_weight"], 3 / 7, rtol=1e-6)
  # Token-level MIS drops the ratio-3 token that the sequence-level variant keeps.
  w, _ = importance_weights(train, roll, mask, method="mis", cap=2.0)
  np.testing.assert_array_equal(w, [[1, 0], [1, 1], [0, 1], [1, 0]])


def test_long_sequences_do_not_overflow():
  roll = np.zeros((2, 200), np.float32)
  train = np.stack([np.full(200, 5.0), np.full(200, -5.0)]).astype(np.float32)
  mask = np.ones((2, 200), bool)
  w, _ = importance_weights(train, roll, mask, method="seq_tis", cap=2.0)
  np.testing.assert_allclose(w[0], 2.0)
  np.testing.assert_allclose(w[1], math.exp(-20.0), rtol=1e-5)
  w, m = importance_weights(train, roll, mask, method="seq_mis", cap=2.0)
  assert np.all(np.asarray(w) == 0) and float(m["frac_dropped"]) == 1.0
  for method in correction.IS_METHODS:
    w, m = importance_weights(train * 20, roll, mask, method=method)
    assert np.all(np.isfinite(w))
    assert all(np.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("method", correction.IS_METHODS)
def test_matches_numpy_on_random_batch(method):
  rng = np.random.default_rng(3)
  roll = rng.normal(-2.0, 1.0, (6, 9)).astype(np.float32)
  train = (roll + rng.normal(0.0, 0.5, (6, 9))).astype(np.float32)
  mask = rng.random((6, 9)) < 0.5
  mask[0] = False  # an all-masked row
  w, m = importance_weights(train, roll, mask, method=method, cap=1.5)
  ref_w, ref_trunc, ref_drop = np_weights(train, roll, mask, method, 1.5)
  np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m["frac_truncated"], ref_trunc, rtol=1e-6)
  np.testing.assert_allclose(m["frac_dropped"], ref_drop, rtol=1e-6)
  np.testing.assert_allclose(m["mean_weight"], ref_w[mask].mean(), rtol=1e-5)
  assert np.all(np.asarray(w)[~mask] == 0)


def test_none_is_the_mask_and_weights_are_detached():
  train, roll, mask = ratio_batch(RATIOS)
  mask[0, 1] = False
  w, m = importance_weights(train, roll, mask, method="none")
  np.testing.assert_array_equal(w, mask.astype(np.float32))
  assert float(m["mean_weight"]) == 1.0
  for method in correction.IS_METHODS:
    g = jax.grad(
      lambda t, r: jnp.sum(correction.importance_weights(t, r, mask, method=method)[0]),
      argnums=(0, 1),
    )(train, roll)
    assert all(np.all(np.asarray(x) == 0) for x in g)


def test_nan_is_never_silently_dropped():
  train, roll, mask = ratio_batch(RATIOS)
  train[0, 2] = np.nan
  for method in ("tis", "mis", "icepop"):
    w, _ = importance_weights(train, roll, mask, method=method)
    assert np.isnan(w[0, 2]) and np.all(np.isfinite(np.delete(np.asarray(w[0]), 2)))
  for method in ("seq_tis", "seq_mis", "geo_mis"):
    w, _ = importance_weights(train, roll, mask, method=method)
    assert np.all(np.isnan(w))


def test_icepop_hand_values():
  # Band [0.5, 5] (IcePop's published one): 0.25 and 6 leave it, 0.5, 1 and 3 keep their ratio.
  w, m = importance_weights(
    *ratio_batch([0.25, 0.5, 1.0, 3.0, 6.0]), method="icepop", cap=5.0, cap_low=0.5
  )
  np.testing.assert_allclose(w[0], [0.0, 0.5, 1.0, 3.0, 0.0], rtol=1e-6)
  assert float(m["frac_dropped"]) == np.float32(0.4) and float(m["frac_truncated"]) == 0.0
  assert float(m["frac_seq_dropped"]) == 1.0
  np.testing.assert_allclose(m["mean_weight"], 4.5 / 5, rtol=1e-6)
  # The default band [1/C, C] = [1/2, 2]: 3 is dropped too.
  w, _ = importance_weights(*ratio_batch(RATIOS), method="icepop", cap=2.0)
  np.testing.assert_allclose(w[0], [0.0, 0.5, 1.0, 0.0], rtol=1e-6)


def test_geo_mis_hand_values():
  # Row 0: ratios 2 and 1/2, geometric mean 1: kept though its product of ratios is 1 and its
  # tokens lie at the ends of [1/2, 2]. Row 1: ratios 1.0014 and 1.0004 (the third token
  # masked out), geometric mean sqrt(1.0014 * 1.0004) = 1.0009: kept at C = 1.001. Row 2: ratios 1.003 and 1.0, mean 1.0015 > 1.001: the whole row is dropped.
  # Row 3: ratios 0.998, 0.999, mean 0.9985 < 1 / 1.001 = 0.999001: dropped.
  ratios = np.array([[2.0, 0.5, 1.0], [1.0014, 1.0004, 7.0], [1.003, 1.0, 1.0], [0.998, 0.999, 1]])
  roll = np.full(ratios.shape, -1.0, np.float32)
  train = (roll + np.log(ratios)).astype(np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]], bool)
  w, m = importance_weights(train, roll, mask, method="geo_mis", cap=1.001)
  np.testing.assert_array_equal(w, [[1, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]])
  assert float(m["frac_dropped"]) == 0.5 and float(m["frac_seq_dropped"]) == 0.5
  # The same rows under seq_mis (the product, with C = 1.001): row 0 kept (product 1), row 1
  # dropped (product 1.0018), rows 2 and 3 dropped: the geometric mean does not grow with length.
  w, m = importance_weights(train, roll, mask, method="seq_mis", cap=1.001)
  np.testing.assert_array_equal(w[:, 0], [1, 0, 0, 0])
  assert float(m["frac_seq_dropped"]) == 0.75


def test_cap_low_sets_the_band_of_the_masks():
  # Band [0.3, 2]: 0.25 and 3 dropped, 0.5 kept; the truncating methods refuse a lower end.
  w, m = importance_weights(*ratio_batch(RATIOS), method="mis", cap=2.0, cap_low=0.3)
  np.testing.assert_array_equal(w[0], [0.0, 1.0, 1.0, 0.0])
  w, _ = importance_weights(*ratio_batch(RATIOS), method="mis", cap=2.0, cap_low=0.25)
  np.testing.assert_array_equal(w[0], [1.0, 1.0, 1.0, 0.0])
  # A row with no completion token counts in no sequence share.
  train, roll, mask = ratio_batch(RATIOS)
  train, roll, mask = (np.concatenate([a, a]) for a in (train, roll, mask))
  mask[1] = False
  _, m = importance_weights(train, roll, mask, method="mis", cap=2.0)
  assert float(m["frac_seq_dropped"]) == 1.0
  with pytest.raises(ValueError, match="cap_low"):
    correction.importance_weights(*ratio_batch(RATIOS), method="mis", cap_low=1.5)


def test_bad_arguments_raise():
  train, roll, mask = ratio_batch(RATIOS)
  with pytest.raises(ValueError, match="none, tis, mis, seq_tis, seq_mis"):
    correction.importance_weights(train, roll, mask, method="ppo")
  with pytest.raises(ValueError, match="cap"):
    correction.importance_weights(train, roll, mask, method="tis", cap=0.5)


def test_weights_feed_the_ppo_loss():
  rng = np.random.default_rng(4)
  roll = rng.normal(-1.0, 0.5, (3, 4)).astype(np.float32)
  train = (roll + rng.normal(0.0, 0.8, (3, 4))).astype(np.float32)
  mask = np.ones((3, 4), bool)
  adv = np.array([1.0, -0.5, 2.0], np.float32)
  w, _ = importance_weights(train, roll, mask, method="tis", cap=2.0)
  num, den, _ = losses.ppo_clip_loss(train, train, adv, mask, is_weights=w)
  ref_w = np.minimum(np.exp(train.astype(np.float64) - roll), 2.0)
  np.testing.assert_allclose(num / den, -(ref_w * adv[:, None]).mean(), rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), method=st.sampled_from(correction.IS_METHODS))
def test_property_weight_ranges(seed, method):
  rng = np.random.default_rng(seed)
  roll = rng.normal(-2.0, 1.0, (4, 5)).astype(np.float32)
  train = (roll + rng.normal(0.0, 1.0, (4, 5))).astype(np.float32)
  mask = rng.random((4, 5)) < 0.7
  w, _ = importance_weights(train, roll, mask, method=method, cap=2.0)
  w = np.asarray(w)
  ref_w, _, _ = np_weights(train, roll, mask, method, 2.0)
  np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7)
  assert np.all((w >= 0) & (w <= 2.0))
  if method.endswith("mis"):
    assert set(np.unique(w)) <= {0.0, 1.0}
  if method.startswith("seq_"):
    for row, m in zip(w, mask):
      assert len(set(row[m])) <= 1
