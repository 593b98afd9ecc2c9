"""The sampler against the full-sequence forward (teacher forcing), determinism, stopping."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import forward, get_config, init_params
from jetrl.precision import get_recipe
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.sampling import STOP_LENGTH, STOP_TOKEN, SamplingConfig, sample

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 43]]


@pytest.fixture(scope="module")
def model():
  cfg = dataclasses.replace(get_config("tiny"), max_seq_len=64)
  params = init_params(cfg, jax.random.PRNGKey(0))
  # Sharpen the random model a little so sampled tokens are not uniform noise.
  params = jax.tree_util.tree_map(lambda a: a * 2.0 if a.ndim >= 2 else a, params)
  return cfg, params


def _train_logprobs(cfg, params, out, precision, temperature):
  batch = make_train_batch(
    out.prompt_tokens,
    out.prompt_mask,
    out.tokens,
    out.mask,
    out.logprobs,
    jnp.zeros(out.tokens.shape[0]),
  )
  fn = jax.jit(
    policy_logprobs, static_argnames=("model_config", "precision", "temperature", "chunk_size")
  )
  lp, _ = fn(
    params,
    model_config=cfg,
    batch=batch,
    precision=precision,
    temperature=temperature,
    chunk_size=16,
  )
  return np.asarray(lp)


def test_greedy_equals_teacher_forced_argmax(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=12, temperature=0.0)
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(0), sc, get_recipe("fp32").rollout)
  for i, p in enumerate(PROMPTS):
    n = int(out.lengths[i])
    seq = np.concatenate([p, np.asarray(out.tokens[i, :n])])
    logits = forward(params, cfg, jnp.asarray(seq[None]), precision=get_recipe("fp32").train)
    expected = np.asarray(jnp.argmax(logits[0, len(p) - 1 : len(p) - 1 + n], axis=-1))
    np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), expected)


def test_fp32_logprobs_equal_full_forward(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=10, temperature=0.7, n=3)
  prec = get_recipe("fp32")
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(1), sc, prec.rollout)
  lp = _train_logprobs(cfg, params, out, prec.train, 0.7)
  m = np.asarray(out.mask)
  assert m.sum() > 20
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], lp[m], atol=1e-5)
  # Hand check of one token: log softmax(logits / T) from the plain forward.
  seq = np.concatenate([PROMPTS[0], np.asarray(out.tokens[0, :1])])
  logits = (
    np.asarray(forward(params, cfg, jnp.asarray(seq[None]), precision=prec.train), np.float64)[
      0, len(PROMPTS[0]) - 1
    ]
    / 0.7
  )
  ref = logits[seq[-1]] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
  assert abs(float(out.logprobs[0, 0]) - ref) < 1e-5


def test_agreement_orders_jet_below_fp8_rollout(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=24, temperature=1.0, n=4)
  gaps = {}
  for name in ("bf16", "jet", "fp8_rollout"):
    r = get_recipe(name)
    out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(2), sc, r.rollout)
    lp = _train_logprobs(cfg, params, out, r.train, 1.0)
    m = np.asarray(out.mask)
    gaps[name] = float(np.abs(np.asarray(out.logprobs)[m] - lp[m]).mean())
  msg = f"mean |dlogp| rollout vs training forward: {gaps}"
  print(msg)
  assert gaps["fp8_rollout"] > 2 * gaps["jet"], msg
  assert gaps["fp8_rollout"] > 2 * gaps["bf16"], msg


def test_stop_tokens_mask_and_reason(model):
  cfg, params = model
  out0 = sample(
    params,
    cfg,
    PROMPTS,
    jax.random.PRNGKey(3),
    SamplingConfig(max_new_tokens=16, temperature=1.0, n=2),
    None,
  )
  # Make the 3rd generated token of row 0 a stop token: that row must stop there.
  stop = int(out0.tokens[0, 2])
  sc = SamplingConfig(max_new_tokens=16, temperature=1.0, n=2, stop_ids=(stop,), pad_id=0)
  out = sample(params, cfg, PROMPTS, jax.random.PRNGKey(3), sc, None)
  toks, mask, lens = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.lengths)
  for i in range(toks.shape[0]):
    hits = np.nonzero(toks[i, : lens[i]] == stop)[0]
    if hits.size:
      assert hits[0] == lens[i] - 1 and out.stop_reason[i] == STOP_TOKEN
    else:
      assert lens[i] == 16 and out.stop_reason[i] == STOP_LENGTH
    assert mask[i, : lens[i]].all() and not mask[i, lens[i] :].any()
    assert (toks[i, lens[i] :] == 0).all() and (np.asarray(out.logprobs)[i, lens[i] :] == 0).all()
  assert lens[0] <= 3 and out.stop_reason[0] == STOP_TOKEN


def test_same_seed_same_samples_and_topk1_is_greedy(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=8, temperature=1.0, n=2)
  a = sample(params, cfg, PROMPTS, jax.random.PRNGKey(5), sc, None)
  b = sample(params, cfg, PROMPTS, jax.random.PRNGKey(5), sc, None)
  c = sample(params, cfg, PROMPTS, jax.random.PRNGKey(6), sc, None)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
  # The n samples of one prompt share the prefill but are drawn independently.
  assert (np.asarray(a.tokens[0]) != np.asarray(a.tokens[1])).any()
  g = sample(
    params, cfg, PROMPTS, jax.random.PRNGKey(0), dataclasses.replace(sc, temperature=0.0), None
  )
  k1 = sample(params, cfg, PROMPTS, jax.random.PRNGKey(7), dataclasses.replace(sc, top_k=1), None)
  np.testing.assert_array_equal(np.asarray(g.tokens[::2]), np.asarray(k1.tokens[::2]))
  p0 = sample(
    params, cfg, PROMPTS, jax.random.PRNGKey(7), dataclasses.replace(sc, top_p=1e-6), None
  )
  np.testing.assert_array_equal(np.asarray(g.tokens[::2]), np.asarray(p0.tokens[::2]))


def test_prompt_lengths_at_the_limits(model):
  cfg, params = model
  sc = SamplingConfig(max_new_tokens=8, temperature=0.0, prompt_len=56)
  long = list(range(1, 57))  # 56 tokens: prompt_len + max_new_tokens == max_seq_len (64)
  out = sample(params, cfg, [[3], long], jax.random.PRNGKey(0), sc, None)
  assert out.tokens.shape == (2, 8) and int(out.lengths.min()) == 8
  logits = forward(params, cfg, jnp.asarray([long + list(np.asarray(out.tokens[1, :7]))]))
  np.testing.assert_array_equal(
    np.asarray(out.tokens[1]), np.asarray(jnp.argmax(logits[0, 55:63], -1))
  )
  with pytest.raises(ValueError, match="more than prompt_len"):
    sample(params, cfg, [long + [1]], jax.random.PRNGKey(0), sc, None)
  with pytest.raises(ValueError, match="max_seq_len"):
    sample(
      params, cfg, [[1]], jax.random.PRNGKey(0), dataclasses.replace(sc, max_new_tokens=9), None
    )
  with pytest.raises(ValueError, match="empty"):
    sample(params, cfg, [[1], []], jax.random.PRNGKey(0), sc, None)
  with pytest.raises(ValueError, match="outside"):
    sample(params, cfg, [[1, cfg.vocab_size]], jax.random.PRNGKey(0), sc, None)


def test_config_errors():
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingConfig(max_new_tokens=0)
  # top_k: None is "no top-k"; 0 (the old spelling of that) and negatives are refused.
  assert SamplingConfig().top_k is None and SamplingConfig(top_k=3).top_k == 3
  for k in (0, -2):
    with pytest.raises(ValueError, match="^top_k: must be a positive number of tokens, or none"):
      SamplingConfig(top_k=k)


def test_top_k_none_keeps_every_token_and_k_keeps_the_k_largest():
  from jetrl.sampling.sampler import _process_logits

  logits = np.array([[0.5, 3.0, -1.0, 2.0, 1.0], [4.0, -2.0, 0.0, 1.0, 3.5]], np.float32)
  t = 2.0
  full = np.asarray(_process_logits(jnp.asarray(logits), SamplingConfig(temperature=t)))
  np.testing.assert_array_equal(full, logits / t)
  two = np.asarray(_process_logits(jnp.asarray(logits), SamplingConfig(temperature=t, top_k=2)))
  expected = np.full_like(logits, -np.inf)
  for r, keep in enumerate(([1, 3], [0, 4])):  # the two largest of each row, by hand
    expected[r, keep] = logits[r, keep] / t
  np.testing.assert_array_equal(two, expected)
  # k at least the vocabulary: nothing is cut.
  big = _process_logits(jnp.asarray(logits), SamplingConfig(temperature=t, top_k=5))
  np.testing.assert_array_equal(np.asarray(big), logits / t)
