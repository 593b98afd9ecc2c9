"""The rollout sampler: jitted prefill and decode over the shared params and a precision.

`sample(params, model_config, prompts, key, config, precision)` left-pads the prompts to a
static width P, prefills them once, repeats the prefilled cache for the `n` samples of each
prompt (the GRPO group), and decodes in a `lax.while_loop` that stops when every row has hit a
stop token or the budget is spent. The KV cache has static shapes and is donated to the decode.
The prefill's attention reads the prompt's own slots only, and a long budget decodes in
segments (`decode_segments`) whose attention reads only the slots filled by then.

Recorded log-probs: for temperature T > 0, the log-prob of the sampled token under the
distribution it was drawn from: softmax(logits / T), truncated by top-k / top-p and
renormalised over the kept tokens when they are set (`jetrl.precision.truncation`), which is
what the update recomputes with `token_logprobs(..., temperature=T, top_k=k, top_p=p)`
(docs/numerics.md, "Log-probs under top-k / top-p"). Greedy decoding (temperature 0) records
log softmax(logits).

Tokens are drawn by inverse CDF in two levels (`jetrl.sampling.categorical`), two uniforms
per row instead of Gumbel-max's one per vocabulary entry. The decode loop runs over a KV cache
with one array per layer and over weights sliced per layer once per rollout
(`rollout_params`), not at every step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.models import (
  KVCache,
  ModelConfig,
  forward_cached,
  init_cache,
  positions_from_mask,
  rollout_weights,
)
from jetrl.kernels import Device, KernelConfig, Plan, resolve_plan
from jetrl.kernels.plan import plan_for
from jetrl.precision import truncation
from jetrl.models.layers import activation_dtype
from jetrl.precision import Precision
from jetrl.sampling.categorical import draw
from jetrl.sampling.config import SamplingConfig

STOP_TOKEN = 0
STOP_LENGTH = 1


class Rollout(NamedTuple):
  """Samples, row-major by prompt then sample: row i*n + j is sample j of prompt i."""

  prompt_tokens: jax.Array  # [R, P] int32, left-padded
  prompt_mask: jax.Array  # [R, P] bool
  tokens: jax.Array  # [R, T] int32, pad_id after the sample stopped
  logprobs: jax.Array  # [R, T] float32, 0 where masked
  mask: jax.Array  # [R, T] bool: generated tokens (the stop token included)
  lengths: jax.Array  # [R] int32
  stop_reason: jax.Array  # [R] int32: STOP_TOKEN or STOP_LENGTH
  # [R, T, L, k] int32: a mixture of experts' choice for each generated token in each layer,
  # made when the token was fed back (best first); None for a dense model.
  routes: Optional[jax.Array] = None


class DecodeState(NamedTuple):
  """The decode loop's carry: R rows, T = max_new_tokens."""

  step: jax.Array  # int32 scalar: decode steps taken
  cache: KVCache
  logits: jax.Array  # [R, V] the next token's logits
  tokens: jax.Array  # [R, T] int32
  logprobs: jax.Array  # [R, T] float32
  done: jax.Array  # [R] bool: the row hit a stop token
  lengths: jax.Array  # [R] int32
  key: jax.Array
  routes: Optional[jax.Array] = None  # [R, T, L, k] int32 (a mixture of experts)


def pad_prompts(
  prompts: Sequence[Sequence[int]], config: SamplingConfig, max_seq_len: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pad token lists to the static width; clear errors for what cannot be sampled."""
  if len(prompts) == 0:
    raise ValueError("sample: no prompts given")
  lens = [len(p) for p in prompts]
  if min(lens) < 1:
    raise ValueError(f"sample: prompt {lens.index(0)} is empty; every prompt needs >= 1 token")
  width = config.prompt_len or -(-max(lens) // 16) * 16
  if max(lens) > width:
    i = int(np.argmax(lens))
    raise ValueError(f"sample: prompt {i} has {lens[i]} tokens, more than prompt_len={width}")
  if width + config.max_new_tokens > max_seq_len:
    raise ValueError(
      f"sample: prompt width {width} + max_new_tokens {config.max_new_tokens} exceeds the "
      f"model's max_seq_len {max_seq_len}: shorten the prompts or the budget"
    )
  tokens = np.full((len(prompts), width), config.pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    p = np.asarray(p, np.int64)
    if p.size and (p.min() < 0 or p.max() >= vocab_size):
      raise ValueError(f"sample: prompt {i} has token ids outside [0, {vocab_size})")
    tokens[i, width - len(p) :] = p
    mask[i, width - len(p) :] = True
  return tokens, mask


def _process_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """Temperature-scaled logits with top-k / top-p truncation (float32; -inf outside the set)."""
  x = logits.astype(jnp.float32) / (config.temperature if config.temperature > 0 else 1.0)
  if not truncation.is_truncated(config.top_k, config.top_p, x.shape[-1]):
    return x
  return jnp.where(truncation.keep_mask(x, config.top_k, config.top_p), x, -jnp.inf)


def _choose(logits: jax.Array, key: jax.Array, config: SamplingConfig, plan: Plan):
  """Next tokens [R] and their recorded log-probs [R], under the distribution drawn from (the
  top-k / top-p truncated one when they cut), by the plan's sampling head (`Plan.choice_keep`,
  `Plan.choice_logprobs`: a batch-invariant plan's is the rule and log-softmax its training
  forward uses, kernels/exact_ops.py and precision/truncation.py, bit for bit)."""
  logits = logits.astype(jnp.float32)
  if config.greedy:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, plan.choice_logprobs(logits, logits, tok, 0.0)
  scaled = logits / config.temperature
  keep = plan.choice_keep(logits, scaled, config.temperature, config.top_k, config.top_p)
  kept = scaled if keep is None else jnp.where(keep, scaled, -jnp.inf)
  tok = draw(key, kept, plan.gpu).astype(jnp.int32)
  if keep is not None:
    keep = truncation.with_targets(keep, tok)  # the drawn token is in the set already
  return tok, plan.choice_logprobs(logits, scaled, tok, config.temperature, keep)


def _repeat_cache(cache, n: int):
  if n == 1:
    return cache
  rep = lambda layers: tuple(jnp.repeat(a, n, axis=0) for a in layers)
  return cache._replace(
    k=rep(cache.k),
    v=rep(cache.v),
    mask=jnp.repeat(cache.mask, n, axis=0),
    v_exp=rep(cache.v_exp),
    k_scale=rep(cache.k_scale),
    v_scale=rep(cache.v_scale),
  )


def _constrain(cache, cache_sharding):
  """Pin the cache to a KVCache of shardings (a mesh layout's), if one is given."""
  if cache_sharding is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, cache_sharding)


@functools.partial(
  jax.jit,
  static_argnames=("model_config", "config", "precision", "cache_dtype", "cache_sharding", "plan"),
)
def _prefill(
  params,
  tokens,
  mask,
  *,
  model_config: ModelConfig,
  config: SamplingConfig,
  precision: Optional[Precision],
  cache_dtype,
  cache_sharding=None,
  plan=None,
):
  b, p = tokens.shape
  plan = plan_for(precision, plan)
  cache = init_cache(model_config, b, p + config.max_new_tokens, cache_dtype, plan=plan)
  positions = positions_from_mask(mask)
  # The cache is empty: the prompt attends to its own p slots, not the whole cache.
  logits, cache = forward_cached(
    params,
    model_config,
    tokens,
    cache,
    positions=positions,
    token_mask=mask,
    precision=precision,
    last_only=True,
    attend_slots=p,
    plan=plan,
  )
  cache = _constrain(_repeat_cache(cache, config.n), cache_sharding)
  return cache, jnp.repeat(logits[:, -1], config.n, axis=0)


# Budgets of at least SEGMENT_MIN_TOKENS new tokens decode in segments (`decode_segments`).
SEGMENT_MIN_TOKENS = 256


def decode_segments(max_new_tokens: int) -> tuple[int, ...]:
  """The decode loop's segment ends (steps): during the steps before end e, attention reads
  only the cache's first P + e slots (all a step up to then can see), so early steps do not
  read the empty end of the cache. (T/4, T/2, T) for a budget T >= SEGMENT_MIN_TOKENS: the
  attention reads about 69% of what one loop over the whole cache does, for three compiled
  loop bodies instead of one; (T,) below it."""
  t = int(max_new_tokens)
  if t < SEGMENT_MIN_TOKENS:
    return (t,)
  return (t // 4, t // 2, t)


@functools.partial(
  jax.jit,
  static_argnames=("model_config", "config", "precision", "cache_sharding", "segments", "plan"),
  donate_argnames=("cache",),
)
def _decode(
  params,
  cache,
  logits,
  prompt_lens,
  key,
  *,
  model_config: ModelConfig,
  config: SamplingConfig,
  precision: Optional[Precision],
  cache_sharding=None,
  segments: Optional[tuple[int, ...]] = None,
  plan=None,
):
  r, t_max = logits.shape[0], config.max_new_tokens
  plan = plan_for(precision, plan)
  segments = segments or (t_max,)
  width = cache.mask.shape[1] - t_max  # the prompts' padded width P
  cache = _constrain(cache, cache_sharding)
  stop_ids = jnp.asarray(config.stop_ids or (-1,), jnp.int32)
  init = DecodeState(
    step=jnp.int32(0),
    cache=cache,
    logits=logits,
    tokens=jnp.full((r, t_max), config.pad_id, jnp.int32),
    logprobs=jnp.zeros((r, t_max), jnp.float32),
    done=jnp.zeros((r,), bool),
    lengths=jnp.zeros((r,), jnp.int32),
    key=key,
    routes=None
    if not model_config.moe
    else jnp.zeros((r, t_max, model_config.n_layers, model_config.experts_per_token), jnp.int32),
  )

  def cond(end):
    return lambda s: (s.step < end) & ~jnp.all(s.done)

  def body(slots):
    def step(s: DecodeState) -> DecodeState:
      key, sub = jax.random.split(s.key)
      tok, lp = _choose(s.logits, sub, config, plan)
      active = ~s.done
      tok = jnp.where(active, tok, config.pad_id)
      lp = jnp.where(active, lp, 0.0)
      hit = active & jnp.isin(tok, stop_ids)
      # Step k writes slot P + k and reads slots up to it: within the segment's `slots`.
      new_logits, new_cache, chosen = forward_cached(
        params,
        model_config,
        tok[:, None],
        s.cache,
        positions=(prompt_lens + s.step)[:, None],
        token_mask=active[:, None],
        precision=precision,
        last_only=True,
        attend_slots=slots,
        plan=plan,
        routing=True,
      )
      routes = None if chosen is None else s.routes.at[:, s.step].set(chosen[:, 0])
      return DecodeState(
        step=s.step + 1,
        cache=_constrain(new_cache, cache_sharding),
        logits=new_logits[:, -1],
        tokens=s.tokens.at[:, s.step].set(tok),
        logprobs=s.logprobs.at[:, s.step].set(lp),
        done=s.done | hit,
        lengths=s.lengths + active.astype(jnp.int32),
        key=key,
        routes=routes,
      )

    return step

  s = init
  for end in segments:  # each a loop whose attention reads the first P + end slots
    s = jax.lax.while_loop(cond(end), body(width + end), s)
  mask = jnp.arange(t_max)[None, :] < s.lengths[:, None]
  # A row is done only by hitting a stop token before the budget ran out.
  reason = jnp.where(s.done, STOP_TOKEN, STOP_LENGTH).astype(jnp.int32)
  # The cache comes back (aliasing the donated buffer); callers drop it.
  return (s.tokens, s.logprobs, mask, s.lengths, reason, s.routes), s.cache


@functools.partial(jax.jit, static_argnames=("precision", "fuse", "plan"))
def rollout_params(params, precision: Optional[Precision], fuse: bool = True, plan=None):
  """The params a rollout reads (`jetrl.models.rollout_weights`): each projection weight
  quantized once with the fprop's own quantizer (bit-identical to what the training forward
  computes from the same params), q / k / v and gate / up fused, and the layers sliced once
  into a tuple (a loop over stacked layers copies each layer's slice at every decode step).
  Costs one copy of the layer weights (FP8 ones under an FP8 recipe) for the rollout. plan:
  the sampler's (default: resolved for `precision` now)."""
  return rollout_weights(params, precision, fuse=fuse, plan=plan)


def sample(
  params,
  model_config: ModelConfig,
  prompts: Sequence[Sequence[int]],
  key: jax.Array,
  config: SamplingConfig,
  precision: Optional[Precision] = None,
  *,
  layout=None,
  kernels: Union[KernelConfig, Device, None] = None,
) -> Rollout:
  """Sample `config.n` completions per prompt with the rollout `precision`.

  params: the one params pytree (the same one the update trains).
  prompts: token-id lists of any lengths >= 1.
  key: a PRNG key; the same key, params and prompts give the same samples.
  precision: a recipe's `.rollout` (None: plain matmuls in the params' dtype).
  layout: a `jetrl.parallel.Layout` (params placed on it): prompt rows go over its batch
    axes and the KV cache is pinned to its cache sharding (batch over the batch axes, kv
    heads over `tensor`). None: whatever `jit` propagates from the params (one device).
  kernels: the kernel settings (`jetrl.kernels.KernelConfig`, a run's `--kernels.*`; None: the
    environment's) for the device traced for, or a `jetrl.kernels.Device` (a compile-only
    target's, `jetrl.aot`): the plan (`jetrl.kernels.resolve_plan`) is resolved once here
    and passed to the rollout weights, the prefill and the decode loop.
  """
  if precision is not None and not isinstance(precision, Precision):
    raise TypeError(f"sample: precision must be a Precision or None, got {type(precision)}")
  plan = resolve_plan(precision, kernels)
  tokens, mask = pad_prompts(prompts, config, model_config.max_seq_len, model_config.vocab_size)
  cache_dtype = activation_dtype(precision, params)
  tokens_in, mask_in, cache_sharding = tokens, mask, None
  if layout is not None:
    rows = layout.rows_sharding(len(tokens))
    tokens_in, mask_in = layout.put(tokens, rows), layout.put(mask, rows)
    cache_sharding = layout.cache_sharding(
      len(tokens) * config.n, value_exponents=plan.grids_cache, scales=plan.kv_fp8
    )
  # Fused projections change which columns a tensor-parallel layout splits: single device only.
  params = rollout_params(params, precision=precision, fuse=layout is None, plan=plan)
  cache, logits = _prefill(
    params,
    tokens_in,
    mask_in,
    model_config=model_config,
    config=config,
    precision=precision,
    cache_dtype=cache_dtype,
    cache_sharding=cache_sharding,
    plan=plan,
  )
  prompt_lens = jnp.repeat(jnp.asarray(mask.sum(1), jnp.int32), config.n)
  out, _ = _decode(
    params,
    cache,
    logits,
    prompt_lens,
    key,
    model_config=model_config,
    config=config,
    precision=precision,
    cache_sharding=cache_sharding,
    segments=decode_segments(config.max_new_tokens),
    plan=plan,
  )
  rep = lambda a: jnp.repeat(jnp.asarray(a), config.n, axis=0)
  return Rollout(rep(tokens), rep(mask), *out)
