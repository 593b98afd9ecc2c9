"""Top-k / top-p: the kept sets and the truncated log-probs and entropies against sets and
numbers written out by hand (numpy float64), for the float32 rule and the exact one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.kernels import exact_ops, resolve_plan
from jetrl.kernels.head import stats_of_logits as _stats_of_logits
from jetrl.precision import get_recipe, truncation
from jetrl.sampling import SamplingConfig
from jetrl.sampling.sampler import _choose

PROBS = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
# The same distribution with its entries in another order: the sets follow the values.
ORDER = np.array([3, 0, 4, 1, 2])
LOGITS = np.log(PROBS)[ORDER].astype(np.float32)[None]  # token j has probability PROBS[ORDER[j]]
SETS = {  # (top_k, top_p) -> kept probabilities, by hand
  (None, 0.6): {0.5, 0.2},  # mass before each: 0, 0.5, 0.7: the first two are < 0.6
  (None, 0.5): {0.5},  # 0.5 is not < 0.5
  (3, 1.0): {0.5, 0.2, 0.15},
  # top-p on the top-3 renormalised: 0.5/0.85, 0.2/0.85, 0.15/0.85; mass before 0, 0.588,
  # 0.824: two kept (on the full distribution p = 0.8 would keep three: 0.7 < 0.8)
  (3, 0.8): {0.5, 0.2},
  (None, 0.99): {0.5, 0.2, 0.15, 0.1, 0.05},  # mass before the last: 0.95
}


def _kept(mask):
  return {float(PROBS[ORDER[j]]) for j in np.flatnonzero(np.asarray(mask)[0])}


@pytest.mark.parametrize("k_p", list(SETS))
def test_kept_sets_by_hand(k_p):
  top_k, top_p = k_p
  assert _kept(truncation.keep_mask(jnp.asarray(LOGITS), top_k, top_p)) == SETS[k_p]
  # The exact rule (the logits unscaled, 1/T = 1): the same sets.
  exact = truncation.keep_mask_exact(jnp.asarray(LOGITS), jnp.float32(1.0), top_k, top_p)
  assert _kept(exact) == SETS[k_p]


def test_ties_at_the_boundary_are_all_kept():
  x = jnp.asarray([[1.0, 1.0, 0.0, 1.0]], jnp.float32)
  np.testing.assert_array_equal(truncation.keep_mask(x, 1, 1.0), [[True, True, False, True]])
  # top-p: the first of three equal tokens already reaches the mass, its equals come with it.
  np.testing.assert_array_equal(truncation.keep_mask(x, None, 0.1), [[True, True, False, True]])
  exact = truncation.keep_mask_exact(x, jnp.float32(1.0), None, 0.1)
  np.testing.assert_array_equal(exact, [[True, True, False, True]])


def test_temperature_scales_before_the_nucleus():
  # At temperature 1/2 the probabilities are PROBS^2 / sum: 0.25, 0.04, 0.0225, 0.01, 0.0025
  # over 0.325: 0.769, 0.123, ...; p = 0.8: mass before the second 0.769 < 0.8, before the
  # third 0.892: two kept (at temperature 1, p = 0.8 keeps three).
  x = jnp.asarray(LOGITS) * 2.0
  assert _kept(truncation.keep_mask(x, None, 0.8)) == {0.5, 0.2}
  exact = truncation.keep_mask_exact(jnp.asarray(LOGITS), jnp.float32(2.0), None, 0.8)
  assert _kept(exact) == {0.5, 0.2}
  assert _kept(truncation.keep_mask(jnp.asarray(LOGITS), None, 0.8)) == {0.5, 0.2, 0.15}


def _np_truncated(probs, kept, target):
  """(log p(target), entropy) of probs renormalised over the indices `kept`, float64."""
  q = np.zeros_like(probs)
  q[list(kept)] = probs[list(kept)] / probs[list(kept)].sum()
  nz = q > 0
  return np.log(q[target]), -(q[nz] * np.log(q[nz])).sum()


def test_truncated_logprob_and_entropy_by_hand():
  z = jnp.asarray(np.log(PROBS).astype(np.float32)[None, None])  # [1, 1, 5]
  keep = truncation.keep_mask(z, None, 0.6)  # tokens 0, 1: 0.5 and 0.2 over 0.7
  for target, want_lp in ((0, np.log(0.5 / 0.7)), (1, np.log(0.2 / 0.7))):
    t = jnp.asarray([[target]])
    lp, ent, _ = _stats_of_logits(z, t, truncation.with_targets(keep, t))
    want_ent = -(5 / 7 * np.log(5 / 7) + 2 / 7 * np.log(2 / 7))
    np.testing.assert_allclose(float(lp[0, 0]), want_lp, rtol=1e-6)
    np.testing.assert_allclose(float(ent[0, 0]), want_ent, rtol=1e-6)
    elp, eent = exact_ops.log_softmax_stats(
      z, t, jnp.float32(1.0), truncation.with_targets(keep, t)
    )
    np.testing.assert_allclose(float(elp[0, 0]), want_lp, rtol=1e-6)
    np.testing.assert_allclose(float(eent[0, 0]), want_ent, rtol=1e-6)


def test_a_target_outside_the_set_is_counted_in_finite():
  """Under jet the trainer's set may leave out the token the sampler drew (a boundary token
  its logits round differently): it is renormalised over the set plus itself, 0.1 / 0.8,
  instead of -inf, and its gradient is finite."""
  z = jnp.asarray(np.log(PROBS).astype(np.float32)[None, None])
  t = jnp.asarray([[3]])

  def lp_of(z):
    keep = truncation.with_targets(truncation.keep_mask(z, None, 0.6), t)
    return _stats_of_logits(z, t, keep)[0][0, 0]

  want_lp, want_ent = _np_truncated(PROBS, {0, 1, 3}, 3)
  np.testing.assert_allclose(float(lp_of(z)), want_lp, rtol=1e-6)
  np.testing.assert_allclose(np.log(0.1 / 0.8), want_lp, rtol=1e-12)
  keep = truncation.with_targets(truncation.keep_mask(z, None, 0.6), t)
  np.testing.assert_allclose(float(_stats_of_logits(z, t, keep)[1][0, 0]), want_ent, rtol=1e-6)
  g = np.asarray(jax.grad(lp_of)(z))[0, 0]
  # d log q_t / d z_j = [j == t] - q_j over the kept set, 0 for the cut token 2 and 4.
  q = np.array([0.5, 0.2, 0.0, 0.1, 0.0]) / 0.8
  np.testing.assert_allclose(g, np.eye(5)[3] * [1, 1, 0, 1, 0] - q, atol=1e-6)


def test_sampler_records_the_truncated_logprob():
  """The drawn tokens lie in the kept set and their recorded log-probs are log(p / kept
  mass), float32 and exact rules alike (temperature 1, top-k 3, top-p 0.8: {0.5, 0.2})."""
  logits = jnp.asarray(np.repeat(LOGITS, 64, axis=0))
  sc = SamplingConfig(temperature=1.0, top_k=3, top_p=0.8)
  for recipe in ("jet", "jet_exact"):
    plan = resolve_plan(get_recipe(recipe).rollout)
    tok, lp = jax.jit(_choose, static_argnums=(2, 3))(logits, jax.random.PRNGKey(0), sc, plan)
    p = PROBS[ORDER[np.asarray(tok)]]
    assert set(p) == {0.5, 0.2}  # both drawn, nothing else
    np.testing.assert_allclose(np.asarray(lp), np.log(p / 0.7), rtol=1e-6)
