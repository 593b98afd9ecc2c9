"""`jetrl.kernels.head.head_stats` (the log-prob head with its own backward, taken when compiling for a
GPU): its values and gradients against JAX's autodiff of the plain chunk statistics and a
float64 numpy reference of the hand-derived gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.kernels import head as lp
from model_helpers import tiny_config


@pytest.mark.parametrize("tied", [True, False])
def test_head_stats_values_and_gradients(tied):
  cfg = tiny_config(vocab=40, d_model=16, heads=(2, 1, 8), d_ff=32, tie_embeddings=tied)
  params = M.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.float32)
  key = "embed" if tied else "lm_head"
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 40, size=(2, 5)), jnp.int32)
  g_l, g_e = (jnp.asarray(rng.normal(size=(2, 5)), jnp.float32) for _ in range(2))
  temp = jnp.float32(0.7)

  def loss(f):
    return lambda h, w, t: jnp.sum(g_l * f(h, w, t)[0]) + jnp.sum(g_e * f(h, w, t)[1])

  mine = lambda h, w, t: lp.head_stats(h, w, targets, t, tied, jnp.float32, False)
  plain = lambda h, w, t: lp.chunk_stats(h, targets, w, tied, jnp.float32, t, "xla")
  for a, b in zip(mine(h, params[key], temp), plain(h, params[key], temp)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  got = jax.grad(loss(mine), argnums=(0, 1, 2))(h, params[key], temp)
  want = jax.grad(loss(plain), argnums=(0, 1, 2))(h, params[key], temp)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
  # dz by hand in float64: g_l (onehot - p) + g_e p (S - z), S = sum p z
  w64 = np.asarray(params[key], np.float64)
  z = np.asarray(h, np.float64) @ (w64.T if tied else w64) / 0.7
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  onehot = np.eye(40)[np.asarray(targets)]
  s = (p * z).sum(-1, keepdims=True)
  dz = np.asarray(g_l)[..., None] * (onehot - p) + np.asarray(g_e)[..., None] * p * (s - z)
  dh = dz @ (w64 if tied else w64.T) / 0.7
  np.testing.assert_allclose(np.asarray(got[0], np.float64), dh, rtol=1e-4, atol=1e-5)
  logp = np.log(np.take_along_axis(p, np.asarray(targets)[..., None], axis=-1)[..., 0])
  entropy = -(p * np.log(p)).sum(-1)
  values = mine(h, params[key], temp)
  np.testing.assert_allclose(np.asarray(values[0], np.float64), logp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(values[1], np.float64), entropy, rtol=1e-5, atol=1e-6)
