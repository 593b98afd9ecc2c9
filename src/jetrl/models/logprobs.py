"""Per-token log-probabilities and entropies without a float32 [B, T, V] logits array.

The sequence is cut into chunks of `chunk_size` positions; each chunk's logits [B, C, V]
(float32) are made, reduced to (log p(target), entropy) and dropped, under `jax.checkpoint`
so that the backward pass recomputes them chunk by chunk instead of storing them. Peak extra
memory is about 4 * B * chunk_size * V bytes (plus the same again in the backward pass).
"""

from __future__ import annotations

import numbers
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.kernels import Plan
from jetrl.kernels.plan import plan_for
from jetrl.models.config import ModelConfig
from jetrl.models.decoder import hidden_states
from jetrl.models.layers import activation_dtype
from jetrl.precision import Precision

DEFAULT_CHUNK = 128


def logprobs_from_hidden(
  params,
  config: ModelConfig,
  h: jax.Array,
  targets: jax.Array,
  *,
  precision: Optional[Precision] = None,
  temperature=1.0,
  chunk_size: int = DEFAULT_CHUNK,
  split_tokens=None,
  top_k: Optional[int] = None,
  top_p: float = 1.0,
  plan: Optional[Plan] = None,
):
  """token_logprobs from final-normed hidden states h [B, T, D] (see `token_logprobs`);
  split_tokens: on a mesh, gathers the head's weight once for all chunks (`head_weight`).
  Each chunk's statistics are the plan's head's (`Plan.head_stats`)."""
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
  if isinstance(temperature, numbers.Real) and not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}")
  b, t, d = h.shape
  if tuple(targets.shape) != (b, t):
    raise ValueError(f"targets must have shape {(b, t)} (like tokens), got {tuple(targets.shape)}")
  cd = activation_dtype(precision, params)
  temperature = jnp.asarray(temperature, jnp.float32)
  targets = targets.astype(jnp.int32)
  key = "embed" if config.tie_embeddings else "lm_head"
  if split_tokens is not None and t > chunk_size:
    params = {**params, key: split_tokens.head_weight(params[key])}
  plan = plan_for(precision, plan)
  stats = plan.head_stats(params[key], config.tie_embeddings, cd, temperature, top_k, top_p)
  if t <= chunk_size:
    logp, ent = stats(h, targets)
  else:
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    tp = jnp.pad(targets, ((0, 0), (0, pad)))
    hc = hp.reshape(b, n, chunk_size, d).swapaxes(0, 1)
    tc = tp.reshape(b, n, chunk_size).swapaxes(0, 1)
    logp, ent = jax.lax.map(lambda args: stats(*args), (hc, tc))
    logp = logp.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]
  chex.assert_shape((logp, ent), (b, t))
  return logp, ent


# Compiled for a GPU, the training forward's tokens a row are padded to a multiple of this.
GPU_TOKEN_TILE = 128


def pad_tokens(tile: int, tokens, targets, positions=None, attention_mask=None):
  """tokens, targets [B, T] (and positions / attention_mask, default arange / all real)
  padded at the end to a multiple of `tile` positions: pad tokens 0, masked out, at the
  positions after the last. Causal attention: no real position sees them."""
  b, t = tokens.shape
  extra = -t % tile
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if attention_mask is None:
    attention_mask = jnp.ones((b, t), jnp.int32)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, extra)))
  after = positions[:, -1:] + 1 + jnp.arange(extra, dtype=positions.dtype)[None, :]
  positions = jnp.concatenate([positions, after.astype(positions.dtype)], axis=1)
  return pad(tokens), pad(targets), positions, pad(attention_mask)


def token_logprobs(
  params,
  config: ModelConfig,
  tokens: jax.Array,
  targets: jax.Array,
  *,
  precision: Optional[Precision] = None,
  positions: Optional[jax.Array] = None,
  attention_mask: Optional[jax.Array] = None,
  temperature=1.0,
  chunk_size: int = DEFAULT_CHUNK,
  remat: bool = False,
  split_tokens=None,
  top_k: Optional[int] = None,
  top_p: float = 1.0,
  plan: Optional[Plan] = None,
  routing: bool = False,
):
  """(logp [B, T], entropy [B, T]), both float32 and differentiable w.r.t. params; with
  `routing`, a mixture of experts' `Routing` of every position and layer as a third
  (`hidden_states`; None for a dense model).

  logp[b, t] = log softmax(logits[b, t] / temperature)[targets[b, t]], and entropy[b, t] is
  the entropy of that same distribution. With top_k / top_p, the distribution is the
  truncated and renormalised one the sampler draws from, its kept set found from these
  logits, the target always counted in (`jetrl.precision.truncation`; docs/numerics.md). chunk_size (static) is the number of sequence
  positions whose logits exist at once; T <= chunk_size runs as one chunk.

  Compiled for a GPU (not the batch-invariant forward), T is padded at the end to whole tiles
  of GPU_TOKEN_TILE (`pad_tokens`): an update's 1023 tokens a row otherwise leave each 1 x 128
  / 128 x 1 quantization pass and the flash-attention kernel a ragged tile to pad per call.
  split_tokens: `hidden_states`' (on a mesh, where the activations' rows live).
  """
  t = tokens.shape[1]
  plan = plan_for(precision, plan)
  if plan.pads_to_tiles and t % GPU_TOKEN_TILE:
    tokens, targets, positions, attention_mask = pad_tokens(
      GPU_TOKEN_TILE, tokens, targets, positions, attention_mask
    )
  h = hidden_states(
    params,
    config,
    tokens,
    precision=precision,
    positions=positions,
    attention_mask=attention_mask,
    remat=remat,
    split_tokens=split_tokens,
    plan=plan,
    routing=routing,
  )
  if routing:
    h, routes = h
  logp, ent = logprobs_from_hidden(
    params,
    config,
    h,
    targets,
    precision=precision,
    temperature=temperature,
    chunk_size=chunk_size,
    split_tokens=split_tokens,
    top_k=top_k,
    top_p=top_p,
    plan=plan,
  )
  if not routing:
    return logp[:, :t], ent[:, :t]
  if routes is not None:
    routes = jax.tree_util.tree_map(lambda a: a[:, :t], routes)
  return logp[:, :t], ent[:, :t], routes
