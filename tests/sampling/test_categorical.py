"""Two-level inverse-CDF sampling against numpy float64 softmax probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.sampling import categorical
from jetrl.sampling.categorical import BLOCK, sample_categorical, sample_gumbel

DRAWS = 40_000


def _softmax64(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max()
  p = np.exp(x)
  return p / p.sum()


@pytest.fixture(scope="module", params=[sample_categorical, sample_gumbel])
def draw(request):
  """Each sampler: the inverse-CDF draw (CPU, TPU) and Gumbel-max (a GPU's)."""
  sampler = request.param
  fn = jax.jit(lambda key, logits: sampler(key, jnp.broadcast_to(logits, (DRAWS,) + logits.shape)))
  return lambda logits, seed=0: np.asarray(fn(jax.random.PRNGKey(seed), jnp.asarray(logits)))


def _check_frequencies(tokens, probs):
  """Every token's count within 5 binomial standard deviations (plus one) of DRAWS * p."""
  counts = np.bincount(tokens, minlength=len(probs))
  assert len(counts) == len(probs), "drew a token id outside the vocabulary"
  expected = DRAWS * probs
  sigma = np.sqrt(DRAWS * probs * (1 - probs))
  bad = np.abs(counts - expected) > 5 * sigma + 1
  assert not bad.any(), (np.flatnonzero(bad), counts[bad], expected[bad])
  assert 0.5 * np.abs(counts / DRAWS - probs).sum() < 0.03  # total variation


def test_matches_softmax_over_blocks(draw):
  # 300 tokens: two full blocks and a partial one (padding must never be drawn); mass is
  # spread over all three blocks and uneven inside them.
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 1.5, size=300).astype(np.float32)
  logits[[5, 140, 290]] += 3.0
  tokens = draw(logits)
  assert tokens.min() >= 0 and tokens.max() < 300
  _check_frequencies(tokens, _softmax64(logits))


def test_excluded_tokens_never_drawn(draw):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=2 * BLOCK + 7).astype(np.float32)
  excluded = np.ones_like(logits, bool)
  keep = [0, 3, BLOCK - 1, BLOCK + 64, 2 * BLOCK + 6]  # block edges and the last token
  excluded[keep] = False
  logits[excluded] = -np.inf
  tokens = draw(logits)
  assert set(np.unique(tokens)) <= set(keep)
  _check_frequencies(tokens, _softmax64(logits))


@pytest.mark.parametrize("where", [0, BLOCK - 1, BLOCK, 299])
def test_single_allowed_token(draw, where):
  logits = np.full(300, -np.inf, np.float32)
  logits[where] = 0.0
  assert (draw(logits) == where).all()


def test_dominant_token_and_tiny_ones(draw):
  # One token holds nearly all the mass; tokens 20 nats below it must (almost) never appear,
  # tokens 3 nats below it at their rate.
  logits = np.full(1000, -20.0, np.float32)
  logits[777] = 0.0
  logits[[3, 500]] = -3.0
  probs = _softmax64(logits)
  tokens = draw(logits, seed=3)
  _check_frequencies(tokens, probs)


def test_same_key_same_tokens_and_rows_independent(draw):
  logits = np.zeros(300, np.float32)
  a, b = draw(logits, seed=7), draw(logits, seed=7)
  np.testing.assert_array_equal(a, b)
  assert len(np.unique(a[:1000])) > 200  # rows get different uniforms
  assert not np.array_equal(a, draw(logits, seed=8))


def test_rounding_at_the_top_never_picks_padding():
  # If u * total rounds up to total, no running sum exceeds it; the pick falls back on the
  # last entry that has mass, never on trailing zero-mass padding.
  from jetrl.sampling.categorical import _pick

  mass = jnp.array([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.7, 0.0, 0.3, 0.0]])
  cum = jnp.cumsum(mass, axis=-1)
  np.testing.assert_array_equal(_pick(cum, mass, jnp.ones((2, 1))), [2, 3])
  np.testing.assert_array_equal(_pick(cum, mass, jnp.zeros((2, 1))), [0, 1])


def test_the_draw_follows_the_plans_device():
  from jetrl.kernels import Device, resolve_plan
  from jetrl.sampling.config import SamplingConfig
  from jetrl.sampling.sampler import _choose

  logits = jnp.zeros((2, 300))
  key = jax.random.PRNGKey(0)
  here = str(jax.make_jaxpr(lambda k, x: categorical.draw(k, x, False))(key, logits))
  assert "cumsum" in here  # the inverse-CDF draw's running sums
  on_gpu = str(jax.make_jaxpr(lambda k, x: categorical.draw(k, x, True))(key, logits))
  assert "argmax" in on_gpu and "cumsum" not in on_gpu
  # The sampler's choice draws as its plan's device says, whatever this machine is.
  cfg = SamplingConfig(max_new_tokens=4, temperature=1.0)
  for platform, sums in (("gpu", False), ("cpu", True)):
    plan = resolve_plan(None, Device(platform, "9.0" if platform == "gpu" else None))
    choose = str(jax.make_jaxpr(lambda x, k: _choose(x, k, cfg, plan))(logits, key))
    assert ("cumsum" in choose) == sums
