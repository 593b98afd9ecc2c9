"""Tests for jetrl.rl.losses against float64 numpy references and hand-computed values."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.rl import losses
from loss_refs import hand_batch, np_aggregate, policy_value_and_grad

AGGS = losses.AGGREGATIONS


# ---------------------------------------------------------------- jitted entry points (once)


def ppo_value_and_grad(logp, old_logp, adv, mask, is_weights=None, **kw):
  """(loss, num, den, metrics), d loss / d logp of `ppo_clip_loss`."""
  return policy_value_and_grad(losses.ppo_clip_loss, logp, old_logp, adv, mask, is_weights, **kw)


@functools.partial(jax.jit, static_argnames=("estimator", "clamp"))
def kl_value_and_grad(logp, ref_logp, mask, *, estimator="k3", clamp=20.0):
  kl = losses.kl_penalty(logp, ref_logp, mask, estimator=estimator, clamp=clamp)
  g = jax.grad(
    lambda lp: jnp.sum(losses.kl_penalty(lp, ref_logp, mask, estimator=estimator, clamp=clamp))
  )(logp)
  return kl, g


aggregate = jax.jit(losses.aggregate, static_argnames=("aggregation", "max_tokens"))


# ---------------------------------------------------------------- numpy float64 references


def np_ppo(
  logp,
  old,
  adv,
  mask,
  *,
  clip_low=0.2,
  clip_high=0.2,
  aggregation="token",
  max_tokens=None,
  is_weights=None,
  dual_clip=None,
):
  """(loss, num, den, grad of loss w.r.t. logp) in float64, written out by hand."""
  logp = np.where(mask, np.asarray(logp, np.float64), 0.0)
  old = np.where(mask, np.asarray(old, np.float64), 0.0)
  adv = np.asarray(adv, np.float64)
  a = np.broadcast_to(adv[:, None], logp.shape) if adv.ndim == 1 else adv
  a = np.where(mask, a, 0.0)
  r = np.exp(logp - old)
  rc = np.clip(r, 1 - clip_low, 1 + clip_high)
  unclipped, clipped = -r * a, -rc * a
  loss_t = np.maximum(unclipped, clipped)
  # Gradient of loss_t w.r.t. logp (d r / d logp = r): the unclipped branch is active when it
  # is the larger one; otherwise the ratio is outside the clip range and the gradient is 0.
  grad_t = np.where(unclipped >= clipped, -r * a, 0.0)
  if dual_clip is not None:
    cap = -dual_clip * a
    capped = (a < 0) & (cap < loss_t)
    loss_t = np.where(capped, cap, loss_t)
    grad_t = np.where(capped, 0.0, grad_t)
  if is_weights is not None:
    w = np.where(mask, np.asarray(is_weights, np.float64), 0.0)
    loss_t, grad_t = loss_t * w, grad_t * w
  num, den, dnum = np_aggregate(loss_t, mask, aggregation, max_tokens)
  safe_den = den if den > 0 else 1.0
  return num / safe_den, num, den, np.where(mask, dnum * grad_t / safe_den, 0.0)


# ---------------------------------------------------------------- PPO clip loss


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("adv", [[1.5, -2.0, 0.7, 0.3], [-1.0, 1.0, -0.4, -0.6]])
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_matches_numpy_on_hand_batch(aggregation, adv, clips):
  logp, old, mask = hand_batch()
  adv = np.array(adv, np.float32)
  kw = dict(clip_low=clips[0], clip_high=clips[1], aggregation=aggregation)
  loss, num, den, _, g = ppo_value_and_grad(logp, old, adv, mask, **kw)
  ref_loss, ref_num, ref_den, ref_g = np_ppo(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(num, ref_num, rtol=1e-5)
  assert float(den) == ref_den
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-30)
  assert np.all(np.asarray(g)[~mask] == 0)


@pytest.mark.parametrize("aggregation", AGGS)
def test_ppo_dual_clip_and_is_weights_match_numpy(aggregation):
  logp, old, mask = hand_batch()
  adv = np.array([-1.5, -2.0, 0.7, -0.3], np.float32)
  w = np.random.default_rng(0).uniform(0.0, 2.0, logp.shape).astype(np.float32)
  kw = dict(clip_low=0.2, clip_high=0.28, aggregation=aggregation, dual_clip=3.0)
  loss, num, den, metrics, g = ppo_value_and_grad(logp, old, adv, mask, w, **kw)
  ref_loss, ref_num, _, ref_g = np_ppo(logp, old, adv, mask, is_weights=w, **kw)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(num, ref_num, rtol=1e-5)
  np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-30)
  # Row 3 has a ratio exp(50) on a negative advantage: without the dual clip the loss is huge.
  assert abs(float(loss)) < 10
  assert float(metrics["dual_clip_frac"]) > 0


@pytest.mark.parametrize(
  "log_ratio, adv, clip_high, loss, grad",
  [
    (math.log(1.5), 1.0, 0.2, -1.2, 0.0),  # upper clip binds: no gradient
    (math.log(1.5), -1.0, 0.2, 1.5, 1.5),  # negative advantage: unclipped, grad -r*A
    (math.log(0.5), -1.0, 0.2, 0.8, 0.0),  # lower clip binds
    (math.log(0.5), 1.0, 0.2, -0.5, -0.5),  # positive advantage: unclipped
    (math.log(1.25), 1.0, 0.2, -1.2, 0.0),  # symmetric clip binds at 1.2 ...
    (math.log(1.25), 1.0, 0.28, -1.25, -1.25),  # ... clip-higher 0.28 does not
    (math.log(1.25), 2.0, 0.28, -2.5, -2.5),
  ],
)
def test_ppo_hand_computed_single_token(log_ratio, adv, clip_high, loss, grad):
  old = np.array([[-1.0]], np.float32)
  logp = old + np.float32(log_ratio)
  out, num, den, _, g = ppo_value_and_grad(
    logp, old, np.array([adv], np.float32), np.ones((1, 1), bool), clip_high=clip_high
  )
  assert float(den) == 1.0
  np.testing.assert_allclose(out, loss, rtol=1e-6)
  np.testing.assert_allclose(g[0, 0], grad, rtol=1e-6, atol=1e-7)


def test_ratio_is_exactly_one_on_policy_and_clipping_changes_nothing():
  rng = np.random.default_rng(1)
  logp = rng.normal(-2.0, 1.0, (3, 7)).astype(np.float32)
  mask = rng.random((3, 7)) < 0.7
  mask[:, 0] = True
  adv = np.array([0.5, -1.25, 2.0], np.float32)
  out_c = ppo_value_and_grad(logp, logp, adv, mask, clip_low=0.2, clip_high=0.2)
  out_u = ppo_value_and_grad(logp, logp, adv, mask, clip_low=0.999, clip_high=1e6)
  loss_c, _, den, metrics, g_c = out_c
  loss_u, _, _, _, g_u = out_u
  assert float(metrics["ratio_mean"]) == 1.0
  assert float(metrics["clip_frac_low"]) == 0.0 and float(metrics["clip_frac_high"]) == 0.0
  np.testing.assert_array_equal(loss_c, loss_u)
  np.testing.assert_array_equal(g_c, g_u)
  a = np.broadcast_to(adv[:, None], mask.shape)
  np.testing.assert_allclose(loss_c, -(a * mask).sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(g_c, -a * mask / float(den), rtol=1e-6)


def test_ppo_metrics_match_numpy():
  logp, old, mask = hand_batch()
  adv = np.array([1.0, -1.0, -1.0, -1.0], np.float32)
  *_, metrics, _ = ppo_value_and_grad(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  r = np.exp(logp.astype(np.float64) - old)
  a = np.broadcast_to(adv[:, None], mask.shape)
  n = mask.sum()
  np.testing.assert_allclose(metrics["clip_frac_low"], ((a < 0) & (r < 0.8) & mask).sum() / n)
  np.testing.assert_allclose(metrics["clip_frac_high"], ((a > 0) & (r > 1.28) & mask).sum() / n)
  np.testing.assert_allclose(metrics["ratio_mean"], r[mask].mean(), rtol=1e-5)
  assert float(metrics["n_tokens"]) == n
  assert float(metrics["dual_clip_frac"]) == 0.0


def test_per_token_advantages_and_no_gradient_into_constants():
  logp, old, mask = hand_batch()
  adv_bt = np.random.default_rng(2).normal(size=logp.shape).astype(np.float32)
  w = np.full(logp.shape, 0.5, np.float32)
  loss, *_ = ppo_value_and_grad(logp, old, adv_bt, mask, w)
  ref_loss, *_ = np_ppo(logp, old, adv_bt, mask, is_weights=w)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)

  def f(old_logp, a, weights):
    num, den, _ = losses.ppo_clip_loss(logp, old_logp, a, mask, is_weights=weights)
    return losses.finalize_loss(num, den)

  grads = jax.grad(f, argnums=(0, 1, 2))(old, adv_bt, w)
  for g in grads:
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("max_tokens", [None, 16])
def test_micro_batches_aggregate_exactly(aggregation, max_tokens):
  logp, old, mask = hand_batch()
  adv = np.array([1.5, -2.0, 0.7, 0.3], np.float32)
  kw = dict(aggregation=aggregation, max_tokens=max_tokens, dual_clip=3.0)
  full, _, _, _, _ = ppo_value_and_grad(logp, old, adv, mask, **kw)
  parts = [
    ppo_value_and_grad(logp[s], old[s], adv[s], mask[s], **kw) for s in (slice(0, 2), slice(2, 4))
  ]
  num = sum(float(p[1]) for p in parts)
  den = sum(float(p[2]) for p in parts)
  np.testing.assert_allclose(num / den, full, rtol=1e-6)
  # The gradient of the combined loss is the concatenation of the parts' numerator gradients.
  _, _, full_den, _, g_full = ppo_value_and_grad(logp, old, adv, mask, **kw)
  g_parts = np.concatenate([np.asarray(p[4]) * max(float(p[2]), 1.0) for p in parts])
  np.testing.assert_allclose(g_parts / float(full_den), g_full, rtol=1e-5, atol=1e-30)


def test_masked_garbage_never_leaks_but_real_nan_shows():
  logp, old, mask = hand_batch()
  adv = np.array([1.0, np.nan, -1.0, 1.0], np.float32)  # NaN only on the all-masked row
  bad_logp, bad_old = logp.copy(), old.copy()
  bad_logp[~mask] = np.nan
  bad_old[~mask] = -np.inf
  w = np.where(mask, 1.0, np.inf).astype(np.float32)
  for aggregation in AGGS:
    loss, _, _, metrics, g = ppo_value_and_grad(
      bad_logp, bad_old, adv, mask, w, aggregation=aggregation
    )
    assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
    assert all(np.isfinite(float(v)) for v in metrics.values())
  bad_logp[0, 0] = np.nan
  loss, *_ = ppo_value_and_grad(bad_logp, old, np.ones(4, np.float32), mask)
  assert np.isnan(float(loss))


def test_all_masked_batch_gives_zero_loss_and_zero_den():
  logp, old, _ = hand_batch()
  mask = np.zeros(logp.shape, bool)
  for aggregation in ("token", "seq_mean_token_mean"):
    loss, num, den, _, g = ppo_value_and_grad(
      logp, old, np.ones(4, np.float32), mask, aggregation=aggregation
    )
    assert float(num) == 0.0 and float(den) == 0.0 and float(loss) == 0.0
    assert np.all(np.asarray(g) == 0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), aggregation=st.sampled_from(AGGS))
def test_property_random_batches_match_numpy_and_split(seed, aggregation):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-2.0, 1.5, (4, 6)).astype(np.float32)
  old = (logp + rng.normal(0.0, 0.4, (4, 6))).astype(np.float32)
  mask = rng.random((4, 6)) < 0.6
  adv = rng.normal(size=4).astype(np.float32)
  kw = dict(clip_low=0.2, clip_high=0.28, aggregation=aggregation)
  loss, num, den, _, g = ppo_value_and_grad(logp, old, adv, mask, **kw)
  ref_loss, ref_num, ref_den, ref_g = np_ppo(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, ref_g, rtol=1e-4, atol=1e-6)
  assert float(den) == ref_den
  halves = [
    ppo_value_and_grad(logp[s], old[s], adv[s], mask[s], **kw) for s in (slice(0, 2), slice(2, 4))
  ]
  np.testing.assert_allclose(sum(float(h[1]) for h in halves), num, rtol=1e-5, atol=1e-6)
  assert sum(float(h[2]) for h in halves) == float(den)


# ---------------------------------------------------------------- aggregate


def test_aggregate_hand_values():
  x = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  assert [float(v) for v in aggregate(x, mask, "token")] == [10.0, 4.0]
  assert [float(v) for v in aggregate(x, mask, "seq_mean_token_mean")] == [6.0, 2.0]
  assert [float(v) for v in aggregate(x, mask, "constant")] == [10.0, 9.0]
  assert [float(v) for v in aggregate(x, mask, "constant", max_tokens=8)] == [10.0, 24.0]
  assert float(losses.finalize_loss(0.0, 0.0)) == 0.0


def test_unknown_names_raise_with_accepted_list():
  logp, old, mask = hand_batch()
  with pytest.raises(ValueError, match="seq_mean_token_mean"):
    losses.ppo_clip_loss(logp, old, np.ones(4, np.float32), mask, aggregation="sequence")
  with pytest.raises(ValueError, match="k1, k2, k3"):
    losses.kl_penalty(logp, old, mask, estimator="k4")
  with pytest.raises(ValueError, match="token"):
    losses.entropy_bonus(logp, mask, "mean")
  with pytest.raises(ValueError, match="max_tokens"):
    losses.aggregate(logp, mask, "constant", max_tokens=0)
  with pytest.raises(ValueError, match="dual_clip"):
    losses.ppo_clip_loss(logp, old, np.ones(4, np.float32), mask, dual_clip=0.5)


# ---------------------------------------------------------------- KL penalty


def np_kl(logp, ref, mask, estimator, clamp=20.0):
  """(per-token kl, d kl / d logp) in float64."""
  d = np.where(mask, ref.astype(np.float64), 0.0) - np.where(mask, logp.astype(np.float64), 0.0)
  if estimator == "k1":
    kl, g = -d, np.ones_like(d)
  elif estimator == "k2":
    kl, g = 0.5 * d * d, -d
  else:
    dc = np.clip(d, -clamp, clamp)
    inside = (d > -clamp) & (d < clamp)
    kl, g = np.exp(dc) - dc - 1.0, np.where(inside, 1.0 - np.exp(dc), 0.0)
  return np.where(mask, kl, 0.0), np.where(mask, g, 0.0)


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_kl_matches_numpy(estimator):
  logp, ref, mask = hand_batch()  # includes +-50 gaps (clamped for k3)
  kl, g = kl_value_and_grad(logp, ref, mask, estimator=estimator)
  ref_kl, ref_g = np_kl(logp, ref, mask, estimator)
  assert np.all(np.isfinite(kl)) and np.all(np.isfinite(g))
  np.testing.assert_allclose(kl, ref_kl, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-6)


def test_kl_k3_hand_values_and_clamp():
  mask = np.ones((1, 3), bool)
  logp = np.array([[-1.0, -1.0, 0.0]], np.float32)
  ref = np.array([[-1.0 + math.log(2.0), -1.0, -50.0]], np.float32)
  kl, _ = kl_value_and_grad(logp, ref, mask, estimator="k3")
  np.testing.assert_allclose(kl[0, 0], 2.0 - math.log(2.0) - 1.0, rtol=1e-5)
  assert float(kl[0, 1]) == 0.0
  np.testing.assert_allclose(kl[0, 2], math.exp(-20.0) + 20.0 - 1.0, rtol=1e-6)
  kl_big, _ = kl_value_and_grad(ref, logp, mask, estimator="k3")  # d = +50 -> clamped to 20
  np.testing.assert_allclose(kl_big[0, 2], math.exp(20.0) - 21.0, rtol=1e-6)
  kl_free, _ = kl_value_and_grad(logp, ref, mask, estimator="k3", clamp=None)
  np.testing.assert_allclose(kl_free[0, 2], 49.0, rtol=1e-6)


@pytest.mark.parametrize("aggregation", AGGS)
def test_kl_and_entropy_aggregate_like_the_loss(aggregation):
  logp, ref, mask = hand_batch()
  kl, _ = kl_value_and_grad(logp, ref, mask, estimator="k3")
  num, den = aggregate(kl, mask, aggregation)
  ref_kl, _ = np_kl(logp, ref, mask, "k3")
  ref_num, ref_den, _ = np_aggregate(ref_kl, mask, aggregation)
  np.testing.assert_allclose(num, ref_num, rtol=1e-5)
  assert float(den) == ref_den
  ent = np.abs(logp)
  e_num, e_den = losses.entropy_bonus(ent, mask, aggregation)
  r_num, r_den, _ = np_aggregate(ent, mask, aggregation)
  np.testing.assert_allclose(e_num, r_num, rtol=1e-6)
  assert float(e_den) == r_den


# ---------------------------------------------------------------- overlong / truncation


def test_overlong_penalty_hand_values():
  lengths = np.array([0, 50, 80, 81, 90, 100, 101, 4000])
  out = losses.overlong_penalty(lengths, max_len=100, buffer_len=20, penalty_factor=1.0)
  np.testing.assert_allclose(out, [0, 0, 0, -0.05, -0.5, -1.0, -1.0, -1.0], rtol=1e-6)
  assert out.dtype == jnp.float32
  out2 = jax.jit(losses.overlong_penalty, static_argnums=(1, 2, 3))(lengths, 100, 20, 0.5)
  np.testing.assert_allclose(out2, 0.5 * np.asarray(out), rtol=1e-6)
  with pytest.raises(ValueError, match="buffer_len"):
    losses.overlong_penalty(lengths, max_len=100, buffer_len=0)
  with pytest.raises(ValueError, match="buffer_len"):
    losses.overlong_penalty(lengths, max_len=10, buffer_len=20)


def test_truncation_mask():
  mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], np.float32)
  out = losses.truncation_mask(np.array([False, True, False]), mask)
  np.testing.assert_array_equal(out, [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
  assert out.dtype == jnp.float32
  out_b = losses.truncation_mask(np.array([True, False, False]), mask.astype(bool))
  assert out_b.dtype == jnp.bool_
  np.testing.assert_array_equal(out_b, [[0, 0, 0], [1, 1, 1], [1, 0, 0]])
