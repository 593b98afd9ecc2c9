"""Drawing one token per row from logits, by inverse CDF in two levels.

`jax.random.categorical` adds Gumbel noise to every logit: it needs V random numbers per row
and step, and on a CPU generating them costs more than the rest of a small model's decode
step (0.9 ms of a 4.8 ms step for 32 rows over 2048 tokens). Inverse-CDF sampling needs two
uniforms per row: one picks a block of `BLOCK` tokens with probability equal to the block's
mass, the second picks a token inside the block with probability proportional to its own.
Two levels keep the float32 running sums short (V / BLOCK blocks, then BLOCK tokens), so a
token's interval is resolved relative to its block's mass rather than to 1; tokens of
probability below about 1e-7 of their block are resolved no better than float32 allows
(Gumbel-max in float32 has a similar floor). Tokens of probability 0 (logit -inf, e.g. after
top-k / top-p) are never drawn.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

BLOCK = 128


def _pick(cum: jax.Array, mass: jax.Array, u: jax.Array) -> jax.Array:
  """Index i with cum[i-1] <= u * total < cum[i], never an entry of zero mass.

  cum: running sums [R, N] of mass [R, N] (>= 0, some entry > 0); u [R, 1] in [0, 1).
  """
  threshold = u * cum[:, -1:]
  idx = jnp.sum(cum <= threshold, axis=-1)
  # u * total can round up to total: then fall back on the last entry with mass.
  n = mass.shape[-1]
  last = n - 1 - jnp.argmax(mass[:, ::-1] > 0, axis=-1)
  return jnp.minimum(idx, last)


def sample_categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
  """One token id per row of `logits` [R, V] (float; -inf for excluded tokens), int32 [R].

  Draws from softmax(logits) along the last axis. Every row needs at least one finite logit.
  """
  chex.assert_rank(logits, 2)
  r, v = logits.shape
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  pad = (-v) % BLOCK
  probs = jnp.pad(probs, ((0, 0), (0, pad))).reshape(r, -1, BLOCK)
  block_mass = jnp.sum(probs, axis=-1)
  k_block, k_token = jax.random.split(key)
  block = _pick(
    jnp.cumsum(block_mass, axis=-1), block_mass, jax.random.uniform(k_block, (r, 1), jnp.float32)
  )
  in_block = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]
  token = _pick(
    jnp.cumsum(in_block, axis=-1), in_block, jax.random.uniform(k_token, (r, 1), jnp.float32)
  )
  return (block * BLOCK + token).astype(jnp.int32)


def sample_gumbel(key: jax.Array, logits: jax.Array) -> jax.Array:
  """One token id per row of `logits` [R, V] by Gumbel-max (`jax.random.categorical`):
  argmax(logits + Gumbel noise), V random numbers a row drawn in the same kernel as the
  argmax. The same distribution as `sample_categorical`, from another random stream."""
  chex.assert_rank(logits, 2)
  return jax.random.categorical(key, logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def draw(key: jax.Array, logits: jax.Array, gpu: bool) -> jax.Array:
  """The sampler's draw for the platform the program is compiled for (`gpu`: a GPU's, as the
  plan's device says, `jetrl.kernels.Plan.gpu`). On a GPU, Gumbel-max:
  one kernel over the logits where the inverse-CDF draw takes eight (its reductions and
  running sums; docs/benchmarks.md, "Compiled programs"), and generating V random numbers
  costs a GPU little. Elsewhere the inverse-CDF draw, which needs two random numbers a row
  (on a CPU, generating V of them costs more than a small model's decode step)."""
  if gpu:
    return sample_gumbel(key, logits)
  return sample_categorical(key, logits)
