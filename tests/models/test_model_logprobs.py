"""token_logprobs: chunked log-probs and entropies equal log_softmax of the full logits."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from model_helpers import perturbed, rel_err, tiny_config

CONFIG = tiny_config("llama", vocab=96, d_model=64, heads=(4, 2, 16), d_ff=96)
B, T = 2, 10


def _reference(params, tokens, targets, mask, temperature):
  """From forward's full logits, with plain jax.nn ops."""
  logits = M.forward(params, CONFIG, tokens, attention_mask=mask) / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, entropy


@pytest.fixture(scope="module")
def data():
  params = perturbed(M.init_params(CONFIG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.2)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, CONFIG.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [7]]))
  return params, tokens, targets, mask


@pytest.mark.parametrize("chunk_size", [3, 4, 64])
def test_values_match_log_softmax(data, chunk_size):
  params, tokens, targets, mask = data
  temperature = 0.7
  logp, ent = jax.jit(M.token_logprobs, static_argnames=("config", "chunk_size"))(
    params,
    config=CONFIG,
    tokens=tokens,
    targets=targets,
    attention_mask=mask,
    temperature=temperature,
    chunk_size=chunk_size,
  )
  want_logp, want_ent = _reference(params, tokens, targets, mask, temperature)
  assert logp.shape == ent.shape == (B, T)
  assert logp.dtype == ent.dtype == jnp.float32
  np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(logp)) <= 0 and float(jnp.min(ent)) >= 0


def test_temperature_is_applied(data):
  params, tokens, targets, mask = data
  hot, _ = M.token_logprobs(
    params, CONFIG, tokens, targets, attention_mask=mask, temperature=2.0, chunk_size=4
  )
  cold, _ = M.token_logprobs(
    params, CONFIG, tokens, targets, attention_mask=mask, temperature=1.0, chunk_size=4
  )
  assert float(jnp.max(jnp.abs(hot - cold))) > 1e-3


def test_gradient_matches(data):
  params, tokens, targets, mask = data
  w = jax.random.normal(jax.random.PRNGKey(3), (2, B, T))

  def loss(p, fn):
    logp, ent = fn(p)
    return jnp.sum(w[0] * logp + w[1] * ent)

  ours = jax.jit(
    jax.grad(
      lambda p: loss(
        p,
        lambda q: M.token_logprobs(
          q, CONFIG, tokens, targets, attention_mask=mask, temperature=0.7, chunk_size=4
        ),
      )
    )
  )
  ref = jax.jit(jax.grad(lambda p: loss(p, lambda q: _reference(q, tokens, targets, mask, 0.7))))
  g_ours, g_ref = ours(params), ref(params)
  flat_ours = jax.tree_util.tree_leaves_with_path(g_ours)
  flat_ref = jax.tree_util.tree_leaves(g_ref)
  for (path, a), b in zip(flat_ours, flat_ref):
    err = rel_err(a, b)
    assert err < 1e-4, f"gradient {jax.tree_util.keystr(path)}: relative error {err:.2e}"


def _avals(jaxpr):
  """Every intermediate abstract value in a jaxpr, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield v.aval
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _avals(sub)


def test_no_full_float32_logits():
  """With a larger vocabulary and T = 4 chunks, no array of B*T*V float32 values exists,
  in the forward or the backward pass."""
  config = tiny_config("qwen3", vocab=4096, d_model=32, heads=(2, 1, 16), d_ff=32, n_layers=1)
  params = M.init_params(config, jax.random.PRNGKey(4))
  tokens = jnp.zeros((2, 64), jnp.int32)

  def loss(p):
    logp, ent = M.token_logprobs(p, config, tokens, tokens, chunk_size=16)
    return jnp.sum(logp) + jnp.sum(ent)

  closed = jax.make_jaxpr(jax.grad(loss))(params)
  limit = 2 * 64 * config.vocab_size
  big = [
    a.shape
    for a in _avals(closed.jaxpr)
    if hasattr(a, "shape") and config.vocab_size in a.shape and np.prod(a.shape) >= limit
  ]
  assert not big, f"arrays as large as the full logits: {big}"
  # The check itself can fail: forward's logits are that large.
  full = jax.make_jaxpr(lambda p: M.forward(p, config, tokens))(params)
  assert any(
    config.vocab_size in a.shape and np.prod(a.shape) >= limit
    for a in _avals(full.jaxpr)
    if hasattr(a, "shape")
  )
