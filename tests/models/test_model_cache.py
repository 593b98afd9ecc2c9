"""Cached decoding (static-shape KV cache, left-padded prompts) reproduces full-sequence logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.precision import get_recipe
from model_helpers import perturbed, rel_err, tiny_config

TOL = 1e-5
CONFIG = tiny_config("qwen2", vocab=64, d_model=64, heads=(4, 2, 16), d_ff=96)


@pytest.fixture(scope="module")
def params():
  return perturbed(M.init_params(CONFIG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))


@pytest.fixture(scope="module")
def step():
  return jax.jit(
    M.forward_cached,
    static_argnames=("config", "precision", "last_only"),
    donate_argnames=("cache",),
  )


@pytest.fixture(scope="module")
def full():
  return jax.jit(M.forward, static_argnames=("config", "precision"))


def test_init_cache_layout():
  cache = M.init_cache(CONFIG, 3, 10, jnp.float32)
  assert len(cache.k) == len(cache.v) == 2  # one array per layer
  for a in cache.k + cache.v:
    assert a.shape == (3, 2, 10, 16) and a.dtype == jnp.float32
  assert cache.mask.shape == (3, 10) and cache.mask.dtype == jnp.bool_ and not cache.mask.any()
  assert cache.index.dtype == jnp.int32 and int(cache.index) == 0


@pytest.mark.parametrize("unstacked", [False, True])
def test_one_token_at_a_time(params, step, full, unstacked):
  """Decoding token by token reproduces the full forward, with the layers stacked or given as
  per-layer dicts (`unstack_layers`, what the sampler's decode loop passes)."""
  b, t = 2, 9
  tokens = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, CONFIG.vocab_size)
  want = np.asarray(full(params, config=CONFIG, tokens=tokens))
  cache = M.init_cache(CONFIG, b, 12, jnp.float32)
  step_params = M.unstack_layers(params) if unstacked else params
  if unstacked:
    assert isinstance(step_params["layers"], tuple) and len(step_params["layers"]) == 2
    np.testing.assert_array_equal(step_params["layers"][1]["wq"], params["layers"]["wq"][1])
  for i in range(t):
    logits, cache = step(
      step_params,
      config=CONFIG,
      tokens=tokens[:, i : i + 1],
      cache=cache,
      positions=jnp.full((b, 1), i, jnp.int32),
      token_mask=jnp.ones((b, 1), bool),
    )
    assert logits.shape == (b, 1, CONFIG.vocab_size) and logits.dtype == jnp.float32
    err = rel_err(logits[:, 0], want[:, i])
    assert err < TOL, f"decode step {i}: relative error {err:.2e} vs the full forward"
  assert int(cache.index) == t
  np.testing.assert_array_equal(np.asarray(cache.mask), np.tile(np.arange(12) < t, (b, 1)))


def _left_pad(rows, width):
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, r in enumerate(rows):
    tokens[i, width - len(r) :] = r
    mask[i, width - len(r) :] = True
  return tokens, mask


@pytest.mark.parametrize("last_only", [False, True])
def test_left_padded_prefill_then_decode(params, step, full, last_only):
  """Prompts of lengths 6, 3, 1 left-padded to 6, prefilled in one call, then 4 decode steps;
  every row's logits equal those of that row run alone without any padding."""
  rng = np.random.RandomState(3)
  prompts = [rng.randint(0, CONFIG.vocab_size, n) for n in (6, 3, 1)]
  steps = rng.randint(0, CONFIG.vocab_size, (3, 4))
  tokens, mask = _left_pad(prompts, 6)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  np.testing.assert_array_equal(M.positions_from_mask(jnp.asarray(mask)), positions)
  cache = M.init_cache(CONFIG, 3, 10, jnp.float32)
  logits, cache = step(
    params,
    config=CONFIG,
    tokens=jnp.asarray(tokens),
    cache=cache,
    positions=jnp.asarray(positions),
    token_mask=jnp.asarray(mask),
    last_only=last_only,
  )
  assert logits.shape == (3, 1 if last_only else 6, CONFIG.vocab_size)
  got_prefill = np.asarray(logits)
  lengths = np.array([len(p) for p in prompts])
  got_steps = []
  for j in range(steps.shape[1]):
    logits, cache = step(
      params,
      config=CONFIG,
      tokens=jnp.asarray(steps[:, j : j + 1]),
      cache=cache,
      positions=jnp.asarray(lengths[:, None] + j, jnp.int32),
      token_mask=jnp.ones((3, 1), bool),
      last_only=last_only,
    )
    got_steps.append(np.asarray(logits[:, 0]))
  assert int(cache.index) == 6 + steps.shape[1]
  for i, prompt in enumerate(prompts):
    seq = np.concatenate([prompt, steps[i]])[None]
    want = np.asarray(full(params, config=CONFIG, tokens=jnp.asarray(seq, jnp.int32)))[0]
    n = len(prompt)
    if last_only:
      err = rel_err(got_prefill[i, 0], want[n - 1])
    else:
      err = rel_err(got_prefill[i, 6 - n :], want[:n])
    assert err < TOL, f"row {i}: prefill relative error {err:.2e}"
    for j in range(steps.shape[1]):
      err = rel_err(got_steps[j][i], want[n + j])
      assert err < TOL, f"row {i}, decode step {j}: relative error {err:.2e}"


def test_chunked_prefill(params, step, full):
  """Two prefill calls of 4 tokens equal one forward of 8 (the cache index advances)."""
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 8), 0, CONFIG.vocab_size)
  want = np.asarray(full(params, config=CONFIG, tokens=tokens))
  cache = M.init_cache(CONFIG, 2, 8, jnp.float32)
  outs = []
  for s in (0, 4):
    logits, cache = step(
      params,
      config=CONFIG,
      tokens=tokens[:, s : s + 4],
      cache=cache,
      positions=jnp.broadcast_to(jnp.arange(s, s + 4), (2, 4)),
      token_mask=jnp.ones((2, 4), bool),
    )
    outs.append(np.asarray(logits))
  err = rel_err(np.concatenate(outs, axis=1), want)
  assert err < TOL, f"chunked prefill: relative error {err:.2e}"


def test_bf16_cache_under_jet_matches_training_forward():
  """Rollout (jet's rollout precision, bf16 cache) vs the training forward (jet train): the
  same FP8 computation, so the logits agree up to bf16 rounding differences."""
  config = tiny_config("llama", vocab=128, d_model=256, heads=(4, 2, 64), d_ff=512)
  recipe = get_recipe("jet")
  params = M.init_params(config, jax.random.PRNGKey(5))
  tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 6), 0, config.vocab_size)
  want = np.asarray(M.forward(params, config, tokens, precision=recipe.train))
  cache = M.init_cache(config, 2, 6, jnp.bfloat16)
  fwd = functools.partial(
    jax.jit(M.forward_cached, static_argnums=1, static_argnames=("precision",)),
    params,
    config,
    precision=recipe.rollout,
  )
  logits, cache = fwd(
    tokens[:, :4],
    cache,
    positions=jnp.broadcast_to(jnp.arange(4), (2, 4)),
    token_mask=jnp.ones((2, 4), bool),
  )
  outs = [np.asarray(logits)]
  for i in (4, 5):
    logits, cache = fwd(
      tokens[:, i : i + 1], cache, positions=jnp.full((2, 1), i), token_mask=jnp.ones((2, 1), bool)
    )
    outs.append(np.asarray(logits))
  assert all(a.dtype == jnp.bfloat16 for a in cache.k + cache.v)
  err = rel_err(np.concatenate(outs, axis=1), want)
  assert err < 2e-2, f"jet rollout (cached) vs jet training forward: relative error {err:.2e}"


def test_unstacked_params_are_checked(params):
  tokens = jnp.zeros((2, 1), jnp.int32)
  kw = dict(positions=jnp.zeros((2, 1), jnp.int32), token_mask=jnp.ones((2, 1), bool))
  layers = M.unstack_layers(params)["layers"]
  with pytest.raises(ValueError, match="tuple of 1 layers, expected 2"):
    M.forward_cached(
      dict(params, layers=layers[:1]), CONFIG, tokens, M.init_cache(CONFIG, 2, 4, jnp.float32), **kw
    )
  bad = (layers[0], dict(layers[1], wq=layers[1]["wq"][:, :8]))
  with pytest.raises(ValueError, match=r"\['layers'\]\[1\]\['wq'\] has shape"):
    M.forward_cached(
      dict(params, layers=bad), CONFIG, tokens, M.init_cache(CONFIG, 2, 4, jnp.float32), **kw
    )
  with pytest.raises(ValueError, match="must be a dict"):  # the full forward needs them stacked
    M.check_params(dict(params, layers=layers), CONFIG)
