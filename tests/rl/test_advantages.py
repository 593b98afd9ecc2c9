"""Tests for jetrl.rl.advantages against float64 numpy references and hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.rl import advantages as adv_lib

group_advantages = jax.jit(
  adv_lib.group_advantages, static_argnames=("group_size", "normalize_std", "eps")
)
batch_normalize = jax.jit(adv_lib.batch_normalize, static_argnames=("eps", "center"))
dynamic_sampling_mask = jax.jit(adv_lib.dynamic_sampling_mask, static_argnames=("group_size",))


def np_group_advantages(rewards, group_size, normalize_std=True, eps=1e-6):
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  centered = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    centered = centered / (r.std(axis=1, ddof=0, keepdims=True) + eps)
  constant = r.max(axis=1) == r.min(axis=1)
  centered[constant] = 0.0
  return centered.reshape(np.shape(rewards))


def test_grpo_hand_values():
  out = group_advantages(np.array([1.0, 0.0, 0.0, 0.0], np.float32), group_size=4)
  # mean 0.25, population std sqrt(0.1875) = 0.4330127
  std = math.sqrt(0.1875)
  np.testing.assert_allclose(out, [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3, rtol=1e-6)
  drgrpo = group_advantages(
    np.array([1.0, 0.0, 0.0, 0.0], np.float32), group_size=4, normalize_std=False
  )
  np.testing.assert_allclose(drgrpo, [0.75, -0.25, -0.25, -0.25], rtol=1e-7)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("shape", [(24,), (6, 4)])
def test_group_advantages_match_numpy(normalize_std, shape):
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=shape).astype(np.float32)
  rewards.reshape(-1, 4)[2] = 0.3  # a zero-std group
  out = group_advantages(rewards, group_size=4, normalize_std=normalize_std)
  assert out.shape == shape and out.dtype == jnp.float32
  ref = np_group_advantages(rewards, 4, normalize_std)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(out).reshape(-1, 4)[2] == 0.0)


@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, 7.7, -2.9])
def test_zero_std_group_gives_exact_zeros(value):
  # The float32 mean of 5 copies of 0.1 need not equal 0.1; the result must still be 0.
  rewards = np.array([value] * 5 + [0.0, 1.0, 1.0, 0.0, 1.0], np.float32)
  for normalize_std in (True, False):
    out = np.asarray(group_advantages(rewards, group_size=5, normalize_std=normalize_std))
    assert np.all(out[:5] == 0.0)
    assert np.all(out[5:] != 0.0)


def test_nan_reward_poisons_only_its_group():
  rewards = np.array([1.0, np.nan, 0.0, 0.0, 1.0, 0.5], np.float32)
  out = np.asarray(group_advantages(rewards, group_size=3))
  assert np.all(np.isnan(out[:3]))
  assert np.all(np.isfinite(out[3:]))


def test_bad_group_size_raises():
  with pytest.raises(ValueError, match="multiple of group_size"):
    adv_lib.group_advantages(np.zeros(10, np.float32), 4)
  with pytest.raises(ValueError, match="group_size"):
    adv_lib.group_advantages(np.zeros((3, 4), np.float32), 5)
  with pytest.raises(ValueError, match="positive int"):
    adv_lib.group_advantages(np.zeros(4, np.float32), 0)


def test_batch_normalize_matches_numpy():
  rng = np.random.default_rng(1)
  adv = rng.normal(2.0, 3.0, (5, 7)).astype(np.float32)
  mask = rng.random((5, 7)) < 0.6
  out = batch_normalize(adv, mask)
  sel = adv[mask].astype(np.float64)
  ref = np.where(mask, (adv - sel.mean()) / (sel.std() + 1e-6), 0.0)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  out_nc = batch_normalize(adv, mask, center=False)
  np.testing.assert_allclose(
    out_nc, np.where(mask, adv / (sel.std() + 1e-6), 0.0), rtol=1e-5, atol=1e-6
  )
  flat = rng.normal(size=9).astype(np.float32)
  np.testing.assert_allclose(
    batch_normalize(flat), (flat - flat.mean()) / (flat.std() + 1e-6), rtol=1e-5, atol=1e-6
  )
  assert np.all(np.asarray(batch_normalize(adv, np.zeros_like(mask))) == 0.0)


def test_dynamic_sampling_counts():
  rewards = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [1, 0, 0.5]], np.float32)
  keep, n_dropped = dynamic_sampling_mask(rewards, group_size=3)
  np.testing.assert_array_equal(keep, [False, True, False, False, True])
  assert keep.dtype == jnp.bool_
  assert int(n_dropped) == 3 and n_dropped.dtype == jnp.int32
  keep_flat, n_flat = dynamic_sampling_mask(rewards.reshape(-1), group_size=3)
  np.testing.assert_array_equal(keep_flat, keep)
  assert int(n_flat) == 3


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), normalize_std=st.booleans())
def test_property_groups_are_centered_and_scaled(seed, normalize_std):
  rng = np.random.default_rng(seed)
  # Binary and graded rewards, with a good chance of constant groups.
  rewards = rng.choice(np.array([0.0, 0.25, 1.0], np.float32), size=32, p=[0.5, 0.1, 0.4])
  out = np.asarray(group_advantages(rewards, group_size=8, normalize_std=normalize_std))
  np.testing.assert_allclose(
    out, np_group_advantages(rewards, 8, normalize_std), rtol=1e-5, atol=1e-5
  )
  groups = out.reshape(4, 8)
  np.testing.assert_allclose(groups.mean(axis=1), 0.0, atol=1e-5)
  constant = rewards.reshape(4, 8).std(axis=1) == 0
  if normalize_std:
    np.testing.assert_allclose(groups.std(axis=1)[~constant], 1.0, rtol=1e-4)
  keep, n_dropped = dynamic_sampling_mask(rewards, group_size=8)
  np.testing.assert_array_equal(keep, ~constant)
  assert int(n_dropped) == constant.sum()


def test_rloo_hand_values():
  # Group [2, 0, 1, 1]: the others' means are 2/3, 4/3, 1, 1. Group [1, 0, 0, 0]: 0 and 1/3.
  # A group of equal rewards gets exactly 0.
  rewards = np.array([2.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0], np.float32)
  out = np.asarray(adv_lib.compute_advantages(rewards, 4, "rloo"))
  want = [4 / 3, -4 / 3, 0, 0, 1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0]
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
  assert np.all(out[8:] == 0.0)
  # The shape comes back as given, and G = 1 has no leave-one-out mean.
  assert adv_lib.rloo_advantages(rewards.reshape(3, 4), 4).shape == (3, 4)
  with pytest.raises(ValueError, match="group_size >= 2"):
    adv_lib.rloo_advantages(rewards, 1)


def test_reinforce_pp_hand_values():
  # Rewards [1, 0, 0, 0 | 1, 1, 1, 1]: batch mean 5/8, population variance 15/64, so a 1 gets
  # (3/8) / sqrt(15/64) = sqrt(3/5) and a 0 gets -(5/8) / sqrt(15/64) = -sqrt(5/3); the
  # group of equal rewards is not zero (no group baseline).
  rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)
  a, b = math.sqrt(3 / 5), -math.sqrt(5 / 3)
  out = adv_lib.compute_advantages(rewards, 4, "reinforce_pp")
  np.testing.assert_allclose(out, [a, b, b, b, a, a, a, a], rtol=1e-5)
  # With the group baseline: [3/4, -1/4, -1/4, -1/4 | 0, 0, 0, 0], batch mean 0, variance
  # 3/32: sqrt(6), -sqrt(2/3), and the equal group stays exactly 0.
  out = np.asarray(adv_lib.compute_advantages(rewards, 4, "reinforce_pp_baseline"))
  c, d = math.sqrt(6), -math.sqrt(2 / 3)
  np.testing.assert_allclose(out, [c, d, d, d, 0, 0, 0, 0], rtol=1e-5)
  assert np.all(out[4:] == 0.0)
  # A batch of equal rewards has no signal: all zeros.
  assert np.all(
    np.asarray(adv_lib.compute_advantages(np.ones(8, np.float32), 4, "reinforce_pp")) == 0
  )


def test_advantage_table_grpo_entries_are_group_advantages():
  rewards = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
  # GRPO: mean 1/4, std sqrt(3)/4: (3/4) / (sqrt(3)/4) = sqrt(3), -(1/4) / (sqrt(3)/4) = -1/sqrt(3)
  s = math.sqrt(3)
  np.testing.assert_allclose(
    adv_lib.compute_advantages(rewards, 4, "grpo"), [s, -1 / s, -1 / s, -1 / s], rtol=1e-5
  )
  np.testing.assert_allclose(
    adv_lib.compute_advantages(rewards, 4, "dr_grpo"), [0.75, -0.25, -0.25, -0.25], rtol=1e-6
  )
  with pytest.raises(ValueError, match="unknown advantage 'ppo'"):
    adv_lib.compute_advantages(rewards, 4, "ppo")
