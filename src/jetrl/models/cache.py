"""The KV cache: static shapes, one write index shared by all rows (left-padded prompts).

A batch of prompts of different lengths is left-padded to a common length P and prefilled in
one call; every row then writes its k / v at the same slots [index, index + T). Which slots
hold real tokens is tracked by `mask`; a query attends to the slots at or before its own slot
whose mask is set. RoPE positions are the caller's (a left-padded row's real tokens count from
0), so a row's attention scores do not depend on how much padding it got.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jetrl.models.config import ModelConfig
from jetrl.kernels import Plan
from jetrl.kernels.plan import plan_for
from jetrl.precision import Precision
from jetrl.precision.kv_cache import KV_BLOCK, KV_DTYPE, kv_scale_shape


class KVCache(NamedTuple):
  """The cache of a batch of B rows with S slots each.

  k, v: tuples of one [B, Hkv, S, Dh] array per layer (compute dtype, post-RoPE keys);
  mask [B, S] bool; index int32.
  v_exp: empty, except in a cache for a batch-invariant precision (`jet_exact`;
    `init_cache(..., precision=...)`): one int32 [B, Hkv, S, 1] array per layer, each value
    row's grid exponent. Such a cache holds every key and value already rounded to its grid
    (`exact_ops.grid_keys`, `grid_values`), written once with the slot, so that a decode step
    grids only its own new key and value (docs/numerics.md, "Bitwise on-policy").
  k_scale, v_scale: empty, except in a cache for a precision with an FP8 KV cache
    (`Precision.kv_cache == "fp8"`): k and v then hold E4M3 values and these their float32
    scales, one [B, Hkv, S, ceil(Dh / 128)] array per layer (one scale per slot, kv head and
    1 x 128 group of the head dimension; jetrl.precision.kv_cache).

  One array per layer (not one stacked [L, ...] array) lets each decode step update and read
  a layer's cache in place; the kv-head axis comes before the slot axis, so the step's batched
  dots over (batch, kv head) read the cache as stored, with no per-step transpose (see the
  sampler section of docs/benchmarks.md for the measured effect).
  """

  k: Tuple[jax.Array, ...]
  v: Tuple[jax.Array, ...]
  mask: jax.Array
  index: jax.Array
  v_exp: Tuple[jax.Array, ...] = ()
  k_scale: Tuple[jax.Array, ...] = ()
  v_scale: Tuple[jax.Array, ...] = ()


def init_cache(
  config: ModelConfig,
  batch: int,
  max_len: int,
  dtype=jnp.bfloat16,
  *,
  precision: Optional[Precision] = None,
  plan: Optional[Plan] = None,
) -> KVCache:
  """An empty cache of `max_len` slots per row (zeros, nothing masked in, index 0).

  precision: the rollout precision (or its `plan`): where the plan's attention grids keys and
  values (`Plan.grids_cache`, a batch-invariant one's), the gridded layout (`v_exp`); under an
  FP8 KV cache (`Plan.kv_fp8`), k and v in E4M3 (whatever `dtype` says) with their scales
  (`k_scale`, `v_scale`; 1, as `quantize` gives an all-zero group).
  """
  for name, value in (("batch", batch), ("max_len", max_len)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
  shape = (batch, config.n_kv_heads, max_len, config.head_dim)
  plan = plan_for(precision, plan)
  per_layer = lambda make: tuple(make() for _ in range(config.n_layers))
  v_exp, scales = (), ()
  if plan.grids_cache:
    v_exp = per_layer(lambda: jnp.zeros(shape[:-1] + (1,), jnp.int32))
  if plan.kv_fp8:
    dtype = KV_DTYPE
    scales = lambda: per_layer(lambda: jnp.ones(kv_scale_shape(shape), jnp.float32))
  return KVCache(
    k=per_layer(lambda: jnp.zeros(shape, dtype)),
    v=per_layer(lambda: jnp.zeros(shape, dtype)),
    mask=jnp.zeros((batch, max_len), bool),
    index=jnp.zeros((), jnp.int32),
    v_exp=v_exp,
    k_scale=scales() if scales else (),
    v_scale=scales() if scales else (),
  )


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """RoPE positions [B, T] of left-padded rows: the number of real tokens before each token
  (0 for padding)."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)


def cache_bytes(
  config: ModelConfig,
  batch: int,
  max_len: int,
  itemsize: int = 2,
  value_exponents: bool = False,
  fp8: bool = False,
) -> int:
  """Bytes of k and v for a cache of this size (the mask and index are negligible), plus the
  value rows' int32 exponents of a batch-invariant precision's cache (`value_exponents`).
  fp8: an FP8 KV cache's (`init_cache` under `Plan.kv_fp8`): one byte a key or value entry
  (`itemsize` is ignored) and a float32 scale per 1 x 128 group of each head."""
  slots = config.n_layers * batch * max_len
  if fp8:
    groups = config.n_kv_heads * -(-config.head_dim // KV_BLOCK)
    kv = 2 * slots * (config.kv_dim + 4 * groups)
  else:
    kv = 2 * slots * config.kv_dim * itemsize
  return kv + (4 * slots * config.n_kv_heads if value_exponents else 0)
