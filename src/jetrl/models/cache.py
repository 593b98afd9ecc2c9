"""The KV cache: static shapes, one write index shared by all rows (left-padded prompts).

A batch of prompts of different lengths is left-padded to a common length P and prefilled in
one call; every row then writes its k / v at the same slots [index, index + T). Which slots
hold real tokens is tracked by `mask`; a query attends to the slots at or before its own slot
whose mask is set. RoPE positions are the caller's (a left-padded row's real tokens count from
0), so a row's attention scores do not depend on how much padding it got.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetrl.models.config import ModelConfig


class KVCache(NamedTuple):
  """k, v [L, B, S, Hkv, Dh] (compute dtype, post-RoPE keys); mask [B, S] bool; index int32."""
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  index: jax.Array


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
  """An empty cache of `max_len` slots per row (zeros, nothing masked in, index 0)."""
  for name, value in (("batch", batch), ("max_len", max_len)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
  shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 mask=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """RoPE positions [B, T] of left-padded rows: the number of real tokens before each token
  (0 for padding)."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)


def cache_bytes(config: ModelConfig, batch: int, max_len: int, itemsize: int = 2) -> int:
  """Bytes of k and v for a cache of this size (the mask and index are negligible)."""
  return 2 * config.n_layers * batch * max_len * config.kv_dim * itemsize
