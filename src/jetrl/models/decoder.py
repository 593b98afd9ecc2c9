"""The decoder: pure functions over one params pytree, layers run with `jax.lax.scan`.

Every projection goes through `jetrl.precision.linear(x, w, precision)` with the stored
weights (never a cast copy), so a recipe's FP8 quantizers see the params themselves.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.models import attention as attn
from jetrl.models.cache import KVCache
from jetrl.models.config import ModelConfig
from jetrl.models.layers import compute_dtype, lm_head, rms_norm, rope_tables, swiglu
from jetrl.models.params import check_params
from jetrl.precision import Precision


def _check_config(config) -> None:
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a jetrl.models.ModelConfig, got {type(config).__name__}")


def _check_tokens(name: str, x, ndim: int = 2) -> None:
  if getattr(x, "ndim", None) != ndim:
    raise ValueError(f"{name} must be a {ndim}-D array, got shape {getattr(x, 'shape', None)}")


def _check_like(name: str, x, shape) -> None:
  if x is not None and tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)} (like tokens), got {tuple(x.shape)}")


def _embed(params, tokens: jax.Array, cd) -> jax.Array:
  return jnp.take(params["embed"], tokens, axis=0).astype(cd)


def _mlp_residual(x, layer, config: ModelConfig, precision, cd):
  h = rms_norm(x, layer["mlp_norm"], config.rms_eps, cd)
  return x + swiglu(h, layer, precision, cd)


def _layer(x, layer, config: ModelConfig, precision, cd, cos, sin, allowed):
  h = rms_norm(x, layer["attn_norm"], config.rms_eps, cd)
  q, k, v = attn.qkv(h, layer, config, precision, cd, cos, sin)
  x = x + attn.output(attn.attend(q, k, v, allowed, cd), layer, precision, cd)
  return _mlp_residual(x, layer, config, precision, cd)


def hidden_states(params, config: ModelConfig, tokens: jax.Array, *,
                  precision: Optional[Precision] = None, positions: Optional[jax.Array] = None,
                  attention_mask: Optional[jax.Array] = None, remat: bool = False) -> jax.Array:
  """Final-normed hidden states [B, T, D] in the compute dtype.

  tokens int [B, T]; positions [B, T] (default arange); attention_mask [B, T] (1 / True for a
  real token, 0 for padding; combined with the causal mask). remat: recompute each layer in
  the backward pass instead of storing its activations.
  """
  _check_config(config)
  check_params(params, config)
  _check_tokens("tokens", tokens)
  b, t = tokens.shape
  _check_like("positions", positions, (b, t))
  _check_like("attention_mask", attention_mask, (b, t))
  cd = compute_dtype(precision, params)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  cos, sin = rope_tables(config, positions, cd)
  allowed = attn.causal_mask(attention_mask, b, t)

  def body(x, layer):
    return _layer(x, layer, config, precision, cd, cos, sin, allowed), None

  if remat:
    body = jax.checkpoint(body)
  x, _ = jax.lax.scan(body, _embed(params, tokens, cd), params["layers"])
  chex.assert_shape(x, (b, t, config.d_model))
  return rms_norm(x, params["final_norm"], config.rms_eps, cd)


def forward(params, config: ModelConfig, tokens: jax.Array, *,
            precision: Optional[Precision] = None, positions: Optional[jax.Array] = None,
            attention_mask: Optional[jax.Array] = None, remat: bool = False) -> jax.Array:
  """float32 logits [B, T, V] (see `hidden_states` for the arguments)."""
  h = hidden_states(params, config, tokens, precision=precision, positions=positions,
                    attention_mask=attention_mask, remat=remat)
  return lm_head(h, params, config, compute_dtype(precision, params))


def forward_cached(params, config: ModelConfig, tokens: jax.Array, cache: KVCache, *,
                   positions: jax.Array, token_mask: jax.Array,
                   precision: Optional[Precision] = None, last_only: bool = False):
  """Run T new tokens against the cache; returns (float32 logits, new cache).

  Writes the new tokens' k / v at slots [index, index + T), sets their mask from token_mask
  ([B, T] bool, False for left padding) and advances index by T. Each new query attends to
  the slots at or before its own whose mask is set. positions [B, T] are RoPE positions.
  The caller keeps index + T <= max_len (a write past the end is clamped, not an error).
  Logits are [B, T, V], or [B, 1, V] for the last new token when last_only.
  """
  _check_config(config)
  check_params(params, config)
  _check_tokens("tokens", tokens)
  b, t = tokens.shape
  _check_like("positions", positions, (b, t))
  _check_like("token_mask", token_mask, (b, t))
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a KVCache from init_cache, got {type(cache).__name__}")
  if cache.k.ndim != 5:
    raise ValueError(f"cache.k must be 5-D (L, B, S, Hkv, Dh), got shape {tuple(cache.k.shape)}")
  n_layers, s = cache.k.shape[0], cache.k.shape[2]
  expected = (config.n_layers, b, s, config.n_kv_heads, config.head_dim)
  if tuple(cache.k.shape) != expected or tuple(cache.v.shape) != expected:
    raise ValueError(f"cache.k / cache.v must have shape {expected} (L, B, S, Hkv, Dh) for "
                     f"this config and batch, got {tuple(cache.k.shape)}")
  if tuple(cache.mask.shape) != (b, s):
    raise ValueError(f"cache.mask must have shape {(b, s)}, got {tuple(cache.mask.shape)}")
  if t > s:
    raise ValueError(f"{t} new tokens do not fit in a cache of {s} slots")

  cd = compute_dtype(precision, params)
  index = jnp.asarray(cache.index, jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  mask = jax.lax.dynamic_update_slice(cache.mask, token_mask.astype(bool), (zero, index))
  q_slots = index + jnp.arange(t, dtype=jnp.int32)
  k_slots = jnp.arange(s, dtype=jnp.int32)
  allowed = (k_slots[None, :] <= q_slots[:, None])[None] & mask[:, None, :]  # [B, T, S]
  cos, sin = rope_tables(config, positions, cd)

  def body(carry, xs):
    x, kc, vc = carry
    layer, i = xs
    h = rms_norm(x, layer["attn_norm"], config.rms_eps, cd)
    q, k, v = attn.qkv(h, layer, config, precision, cd, cos, sin)
    start = (i, zero, index, zero, zero)
    kc = jax.lax.dynamic_update_slice(kc, k.astype(kc.dtype)[None], start)
    vc = jax.lax.dynamic_update_slice(vc, v.astype(vc.dtype)[None], start)
    k_all = jax.lax.dynamic_index_in_dim(kc, i, 0, keepdims=False)
    v_all = jax.lax.dynamic_index_in_dim(vc, i, 0, keepdims=False)
    x = x + attn.output(attn.attend(q, k_all, v_all, allowed, cd), layer, precision, cd)
    return (_mlp_residual(x, layer, config, precision, cd), kc, vc), None

  layer_ids = jnp.arange(n_layers, dtype=jnp.int32)
  (x, k, v), _ = jax.lax.scan(body, (_embed(params, tokens, cd), cache.k, cache.v),
                              (params["layers"], layer_ids))
  if last_only:
    x = x[:, -1:, :]
  h = rms_norm(x, params["final_norm"], config.rms_eps, cd)
  logits = lm_head(h, params, config, cd)
  return logits, KVCache(k=k, v=v, mask=mask, index=index + t)
