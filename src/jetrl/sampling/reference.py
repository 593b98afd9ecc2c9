"""Rows sampled by the training forward itself: the on-policy reference for a rollout.

A rollout samples token t of a row from the *rollout* forward (a KV-cache decode, perhaps in
another precision). The training step scores those rows with the *training* forward over the
whole sequence. `resample_with_forward` answers "which rows would the training forward have
sampled with the same random numbers?": it draws every token from the training forward's own
distribution, with the uniforms the sampler used at that step (the same split chain of the
same key, `jetrl.sampling.sampler._decode`), so that where the two forwards agree the rows are
the same tokens, and they differ only where the rollout's rounding changed a draw (a coupled
pair of samples).

Sampling token by token with a full forward per token costs T forwards of the whole
sequence. The rows are found instead as the fixed point of a parallel (Jacobi) iteration,
started from the rollout's own tokens:

  c <- rollout tokens
  repeat: logits = training forward over c (one pass, every position)
          r[t] = draw(u_t, logits[t]) for every t, then the stop rule (pad after a stop)
          until r == c;  c <- r

At a fixed point every token is the draw of the training forward given the row's own
prefix, which is exactly the sequential sample with these uniforms. Each pass fixes at least
one more position of every row that has not converged (the prefix before the first
disagreement is already right, and the token at it is now drawn from the right prefix), so
at most T + 1 passes are needed; where the rollout agrees with the training forward it ends
after one. The fixed point needs a row's logits at position t to depend on its tokens before
t alone: true of a causal model whose activations are scaled per token (bf16, the 1x128
block-scaled FP8 forward, the batch-invariant forward), not of per-tensor FP8 scaling, whose
one activation scale reads the whole batch (refused).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jetrl.models import ModelConfig, forward, positions_from_mask
from jetrl.kernels import resolve_plan
from jetrl.precision import Precision
from jetrl.sampling.config import SamplingConfig
from jetrl.sampling.sampler import STOP_LENGTH, STOP_TOKEN, Rollout, _choose


class Resampled(NamedTuple):
  """The training forward's own rows (a Rollout) and how the iteration went."""

  rollout: Rollout  # logprobs: the training forward's, as the sampler would record them
  passes: jax.Array  # int32: forward passes made
  converged: jax.Array  # bool: the fixed point was reached within max_passes


def step_keys(key: jax.Array, steps: int) -> jax.Array:
  """The keys the sampler draws decode steps 0 .. steps-1 with: [steps, 2] (the same chain
  of splits as the decode loop: key, sub = split(key) at every step)."""

  def one(k, _):
    k, sub = jax.random.split(k)
    return k, sub

  return jax.lax.scan(one, key, None, length=steps)[1]


def _check_per_token(precision: Optional[Precision]) -> None:
  for name in ("fprop",):
    g = getattr(precision, name, None) if precision is not None else None
    if g is not None and g.scaling != "block":
      raise ValueError(
        f"resample_with_forward: the training forward's {name} uses {g.scaling!r} scaling, "
        "whose one activation scale reads the whole batch, so a token's logits depend on "
        "other positions and the fixed point is not the sequential sample; accepted: "
        "block-scaled FP8 or no FP8 fprop"
      )


def _stop_rule(tokens, stop_ids, pad_id):
  """The sampler's rule on drawn tokens [R, T]: a row ends at its first stop token (kept);
  after it the row holds pad_id. Returns (tokens, lengths, hit_stop)."""
  t = tokens.shape[1]
  is_stop = jnp.isin(tokens, stop_ids)
  first = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), t)
  lengths = jnp.minimum(first + 1, t).astype(jnp.int32)
  keep = jnp.arange(t)[None, :] < lengths[:, None]
  return jnp.where(keep, tokens, pad_id), lengths, first < t


@functools.partial(jax.jit, static_argnames=("model_config", "config", "precision", "max_passes"))
def resample_with_forward(
  params,
  rollout: Rollout,
  key: jax.Array,
  *,
  model_config: ModelConfig,
  config: SamplingConfig,
  precision: Optional[Precision],
  max_passes: int,
) -> Resampled:
  """The rows the training forward under `precision` samples with the uniforms of `key`.

  rollout: the sampler's rows for the same prompts (their prompt arrays and, as the start
    of the iteration, their tokens); key: the key the sampler was called with.
  max_passes: the most forward passes (T + 1 always suffices); a batch not converged by
    then comes back with `converged` False and rows that are not yet the training forward's.
  """
  _check_per_token(precision)
  if config.greedy:
    raise ValueError("resample_with_forward: needs temperature > 0 (greedy rows are not drawn)")
  r, t = rollout.tokens.shape
  subs = step_keys(key, t)
  stop_ids = jnp.asarray(config.stop_ids or (-1,), jnp.int32)
  plan = resolve_plan(precision)
  p = rollout.prompt_tokens.shape[1]
  draw_all = jax.vmap(
    lambda logits, sub: _choose(logits, sub, config, plan), in_axes=(1, 0), out_axes=1
  )

  def redraw(tokens):
    seq = jnp.concatenate([rollout.prompt_tokens, tokens], axis=1)
    # Completion positions count as real tokens whatever they hold: causality keeps a
    # position's logits independent of what follows it.
    seq_mask = jnp.concatenate([rollout.prompt_mask, jnp.ones((r, t), bool)], axis=1)
    positions = positions_from_mask(seq_mask)
    logits = forward(
      params,
      model_config,
      seq[:, :-1],
      precision=precision,
      plan=plan,
      positions=positions[:, :-1],
      attention_mask=seq_mask[:, :-1],
    )[:, p - 1 :]
    drawn, logp = draw_all(logits, subs)
    new, lengths, hit = _stop_rule(drawn, stop_ids, config.pad_id)
    keep = jnp.arange(t)[None, :] < lengths[:, None]
    return new, jnp.where(keep, logp, 0.0), lengths, hit

  def cond(s):
    return (~s[0]) & (s[1] < max_passes)

  def body(s):
    _, n, tokens, *_ = s
    new, logp, lengths, hit = redraw(tokens)
    return (jnp.all(new == tokens), n + 1, new, logp, lengths, hit)

  start = _stop_rule(rollout.tokens, stop_ids, config.pad_id)[0]
  init = (
    jnp.bool_(False),
    jnp.int32(0),
    start,
    jnp.zeros((r, t), jnp.float32),
    jnp.zeros((r,), jnp.int32),
    jnp.zeros((r,), bool),
  )
  done, n, tokens, logp, lengths, hit = jax.lax.while_loop(cond, body, init)
  mask = jnp.arange(t)[None, :] < lengths[:, None]
  reason = jnp.where(hit, STOP_TOKEN, STOP_LENGTH).astype(jnp.int32)
  out = Rollout(rollout.prompt_tokens, rollout.prompt_mask, tokens, logp, mask, lengths, reason)
  return Resampled(out, n, done)
