"""Top-k / top-p truncation of a next-token distribution: one rule for the sampler and the
trainer (docs/numerics.md, "Log-probs under top-k / top-p").

The sampler draws from the truncated, renormalised distribution and records the sampled
token's log-prob under it; the training forward computes its log-probs under the same rule
from its own logits. Both find the kept set with `keep_mask` (or, under a batch-invariant
precision, `keep_mask_exact`, whose decisions are exact sums on the same values the exact
log-softmax uses) from the temperature-scaled logits of their own forward:

  top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th all kept);
  top-p: of those, sorted by probability, keep the shortest prefix whose mass before the last
         kept token is < p, and every token as likely as the last kept one (ties all kept);

then renormalise over the kept set. A token the caller names (the sampled one) is always
counted in: `with_targets`. In the sampler that changes nothing (the token was drawn from the
set); in the trainer it makes a token that its own set leaves out (under `jet`, a boundary
token whose logit the two forwards round differently) a token of finite log-prob, renormalised
over the trainer's set plus itself, instead of -inf (whose PPO ratio would be NaN).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jetrl.precision.exact_math import exp64
from jetrl.precision.exact import EXACT_BITS, F64, exponent_bound, pow2, x64


def is_truncated(top_k: Optional[int], top_p: float, vocab_size: Optional[int] = None) -> bool:
  """Whether top-k / top-p remove any token (static)."""
  k_cuts = top_k is not None and (vocab_size is None or top_k < vocab_size)
  return bool(k_cuts or top_p < 1.0)


def _top_k(x: jax.Array, top_k: Optional[int]) -> jax.Array:
  """bool [..., V]: x at least its k-th largest along the last axis."""
  if top_k is None or top_k >= x.shape[-1]:
    return jnp.ones(x.shape, bool)
  kth = jax.lax.top_k(x, top_k)[0][..., -1:]
  return x >= kth


def _threshold(values: jax.Array, keep_sorted: jax.Array, sorted_values: jax.Array):
  """bool: values at least the last kept entry of a descending sort (>= 1 entry kept)."""
  n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1, keepdims=True), 1)
  last = jnp.take_along_axis(sorted_values, n_keep - 1, axis=-1)
  return values >= last


def keep_mask(x: jax.Array, top_k: Optional[int], top_p: float) -> jax.Array:
  """bool [..., V]: the tokens top-k then top-p keep, from float32 temperature-scaled logits
  x [..., V] (softmax(x) is the untruncated distribution). No gradient flows through it."""
  x = jax.lax.stop_gradient(x.astype(jnp.float32))
  keep = _top_k(x, top_k)
  if top_p < 1.0:
    xk = jnp.where(keep, x, -jnp.inf)
    desc = -jnp.sort(-xk, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & _threshold(xk, before < top_p, desc)
  return keep


def keep_mask_exact(z: jax.Array, inv_t: jax.Array, top_k: Optional[int], top_p: float):
  """`keep_mask` for the batch-invariant forward, from its float32 logits z [..., V] (not yet
  scaled) and float32(1/T): the same kept set in every program that has the same logits.

  top-k compares logits (exact); top-p sorts the unnormalised probabilities
  e = exp64((z - max z) * inv_t) (the exact log-softmax's own terms), rounds them to integers
  on a grid set by the largest (53 - ceil(log2 V) bits), whose running sums are exact in any
  order, and keeps the prefix whose mass before it is < p times the total."""
  z = jax.lax.stop_gradient(z.astype(jnp.float32))
  keep = _top_k(z, top_k)
  if top_p < 1.0:
    bits = EXACT_BITS - max(z.shape[-1] - 1, 0).bit_length()
    with x64():
      top = jnp.max(z, axis=-1, keepdims=True).astype(F64)
      u = (z.astype(F64) - top) * jnp.asarray(inv_t, jnp.float32).astype(F64)
      e = jnp.where(keep, exp64(u), 0.0)
      desc = -jnp.sort(-e, axis=-1)
      scale = pow2(bits - exponent_bound(desc[..., :1]))
      units = jnp.round(desc * scale)  # integers: their running sums are exact
      before = jnp.cumsum(units, axis=-1) - units
      keep = keep & _threshold(e, before < top_p * jnp.sum(units, axis=-1, keepdims=True), desc)
  return keep


def with_targets(keep: jax.Array, targets: jax.Array) -> jax.Array:
  """keep [..., V] with each row's target token [...] counted in (see the module docstring)."""
  iota = jax.lax.broadcasted_iota(jnp.int32, keep.shape, keep.ndim - 1)
  return keep | (iota == targets[..., None].astype(jnp.int32))
