"""The training forward's own rows (resample_with_forward) against an independent token-by-token
sampler, and against the sampler itself where the two forwards are bitwise the same."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import forward, get_config, init_params, positions_from_mask
from jetrl.precision import Fp8Gemm, Precision, get_recipe
from jetrl.sampling import SamplingConfig, pad_prompts, sample, sample_categorical
from jetrl.sampling.reference import resample_with_forward

PROMPTS = [[1, 2, 3, 4, 5], [7, 9], [9, 8, 7, 6, 5, 4, 3]]
T = 7


@pytest.fixture(scope="module")
def model():
  cfg = dataclasses.replace(get_config("tiny"), max_seq_len=32)
  params = init_params(cfg, jax.random.PRNGKey(0))
  params = jax.tree_util.tree_map(lambda a: a * 2.0 if a.ndim >= 2 else a, params)
  return cfg, params


def _sequential(params, cfg, prompts, key, sc, precision):
  """Token by token: a full forward over the prefix, then one draw with the decode step's key
  (key, sub = split(key) per step), stop tokens end a row. Written without the sampler."""
  tokens, mask = pad_prompts(prompts, sc, cfg.max_seq_len, cfg.vocab_size)
  tokens, mask = np.repeat(tokens, sc.n, 0), np.repeat(mask, sc.n, 0)
  r = tokens.shape[0]
  out = np.full((r, sc.max_new_tokens), sc.pad_id, np.int32)
  done = np.zeros(r, bool)
  for t in range(sc.max_new_tokens):
    key, sub = jax.random.split(key)
    seq = np.concatenate([tokens, out[:, :t]], 1)
    seq_mask = np.concatenate([mask, np.ones((r, t), bool)], 1)
    logits = forward(
      params,
      cfg,
      jnp.asarray(seq),
      precision=precision,
      positions=positions_from_mask(jnp.asarray(seq_mask)),
      attention_mask=jnp.asarray(seq_mask),
    )[:, -1]
    tok = np.asarray(sample_categorical(sub, logits / sc.temperature))
    tok = np.where(done, sc.pad_id, tok)
    out[:, t] = tok
    done |= (~done) & np.isin(tok, sc.stop_ids)
  return out


@pytest.mark.parametrize("stop", [False, True])
def test_fixed_point_is_the_token_by_token_sample(model, stop):
  cfg, params = model
  f32 = Precision("float32")
  sc = SamplingConfig(max_new_tokens=T, temperature=1.0, n=2, pad_id=0)
  key = jax.random.PRNGKey(3)
  want = _sequential(params, cfg, PROMPTS, key, sc, f32)
  if stop:  # row 0's third token becomes a stop token: that row ends there
    sc = dataclasses.replace(sc, stop_ids=(int(want[0, 2]),))
    want = _sequential(params, cfg, PROMPTS, key, sc, f32)
  # Start the iteration from other rows (another key): the fixed point must not depend on it.
  start = sample(params, cfg, PROMPTS, jax.random.PRNGKey(99), sc, f32)
  res = resample_with_forward(
    params, start, key, model_config=cfg, config=sc, precision=f32, max_passes=T + 1
  )
  assert bool(res.converged)
  assert 1 <= int(res.passes) <= T + 1
  np.testing.assert_array_equal(np.asarray(res.rollout.tokens), want)
  lengths = np.asarray(res.rollout.lengths)
  if stop:
    hit = np.isin(want, sc.stop_ids)
    first = np.where(hit.any(1), hit.argmax(1) + 1, T)
    np.testing.assert_array_equal(lengths, first)
    assert (first < T).any(), "the test needs a row that stops early"
  else:
    assert (lengths == T).all()
  # The recorded log-probs are the training forward's log-softmax at the temperature.
  lp = np.asarray(res.rollout.logprobs)
  assert np.all(lp[np.asarray(res.rollout.mask)] < 0)
  assert np.all(lp[~np.asarray(res.rollout.mask)] == 0)


def test_bitwise_forward_gives_the_samplers_rows_in_one_pass(model):
  cfg, params = model
  exact = get_recipe("jet_exact")
  sc = SamplingConfig(max_new_tokens=T, temperature=0.7, n=2, pad_id=0)
  key = jax.random.PRNGKey(5)
  out = sample(params, cfg, PROMPTS, key, sc, exact.rollout)
  res = resample_with_forward(
    params, out, key, model_config=cfg, config=sc, precision=exact.train, max_passes=T + 1
  )
  assert int(res.passes) == 1 and bool(res.converged)
  np.testing.assert_array_equal(np.asarray(res.rollout.tokens), np.asarray(out.tokens))
  np.testing.assert_array_equal(
    np.asarray(res.rollout.logprobs).view(np.uint32), np.asarray(out.logprobs).view(np.uint32)
  )


def test_refuses_per_tensor_scaling_and_greedy(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=T, temperature=1.0, n=1, pad_id=0)
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(0), sc, None)
  tensor = Precision("bfloat16", fprop=Fp8Gemm(scaling="tensor"))
  with pytest.raises(ValueError, match="'tensor' scaling"):
    resample_with_forward(
      params,
      out,
      jax.random.PRNGKey(0),
      model_config=cfg,
      config=sc,
      precision=tensor,
      max_passes=2,
    )
  with pytest.raises(ValueError, match="temperature > 0"):
    resample_with_forward(
      params,
      out,
      jax.random.PRNGKey(0),
      model_config=cfg,
      config=dataclasses.replace(sc, temperature=0.0),
      precision=None,
      max_passes=2,
    )
