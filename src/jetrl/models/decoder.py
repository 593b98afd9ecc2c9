"""The decoder: pure functions over one params pytree, layers run with `jax.lax.scan`.

Every block runs as a `jetrl.kernels.Plan` says (resolved for the precision where the caller
gives none): every projection through `jetrl.precision.linear(x, w, precision)` on the plan's
kernels, with the stored weights (never a cast copy), so a recipe's FP8 quantizers see the
params themselves.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.kernels import Plan
from jetrl.kernels.plan import plan_for
from jetrl.models import attention as attn
from jetrl.models.cache import KVCache
from jetrl.models.config import ModelConfig
from jetrl.models.layers import activation_dtype, lm_head, project, rope_tables, swiglu
from jetrl.models.moe import Routing, moe_mlp
from jetrl.models.params import check_params, unstack_layers
from jetrl.precision import Precision
from jetrl.precision.kv_cache import KV_BLOCK, KV_DTYPE


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


def _rows(x) -> int:
  return math.prod(x.shape[:-1])


def _mlp_residual(x, layer, config: ModelConfig, plan: Plan, cd):
  """(x + the layer's MLP of x, its Routing: None for a dense MLP)."""
  if "router" in layer:  # a mixture of experts (jetrl.models.moe)
    y, routing = moe_mlp(
      plan.norm(x, layer["mlp_norm"], config.rms_eps, cd), layer, config, plan, cd
    )
    return x + y.astype(x.dtype), routing
  wg, wu, wd = (layer.get(n) for n in ("w_gate", "w_up", "w_down"))
  if (
    wg is not None
    and plan.fused_mlp(_rows(x), wg, wu, wd)
    and plan.fused_norm(_rows(x), layer["mlp_norm"], wg)
  ):  # a GPU training step under blockwise FP8: the norm's kernel writes gate / up's groups
    norm = (layer["mlp_norm"], config.rms_eps)
    return x + plan.mlp(x, wg, wu, wd, norm=norm).astype(x.dtype), None
  h = plan.norm(x, layer["mlp_norm"], config.rms_eps, cd)
  return x + swiglu(h, layer, plan, cd), None


def _qkv(x, layer, config: ModelConfig, plan: Plan, cd, cos, sin):
  """q, k, v of the layer's attention from the residual stream x (its RMSNorm first)."""
  w = attn.qkv_weight(layer, plan)
  if w is not None and plan.fused_norm(_rows(x), layer["attn_norm"], w):
    # a GPU training step under blockwise FP8: the norm's kernel writes the GEMM's groups
    y = plan.norm_linear(x, layer["attn_norm"], config.rms_eps, w)
    return attn.qkv_from(y, layer, config, plan, cd, cos, sin)
  h = plan.norm(x, layer["attn_norm"], config.rms_eps, cd)
  return attn.qkv(h, layer, config, plan, cd, cos, sin)


def _layer(x, layer, config: ModelConfig, plan: Plan, cd, cos, sin, allowed, flash_mask=None):
  """(x after one layer, its Routing or None); `flash_mask` = (attention_mask,) when the
  forward attends with the flash kernel (`Plan.use_flash`), else None."""
  q, k, v = _qkv(x, layer, config, plan, cd, cos, sin)
  k, v = plan.cached_kv(k, v)  # as a KV cache holds them (FP8 under an FP8 KV cache)
  if flash_mask is not None:
    out = plan.attend_flash(q, k, v, flash_mask[0], cd)
  else:
    out = plan.attend(q, attn.heads_first(k), attn.heads_first(v), allowed, cd)
  x = x + attn.output(out, layer, plan, cd)
  return _mlp_residual(x, layer, config, plan, cd)


def hidden_states(
  params,
  config: ModelConfig,
  tokens: jax.Array,
  *,
  precision: Optional[Precision] = None,
  positions: Optional[jax.Array] = None,
  attention_mask: Optional[jax.Array] = None,
  remat: bool = False,
  split_tokens: Optional[Callable[[jax.Array], jax.Array]] = None,
  plan: Optional[Plan] = None,
  routing: bool = False,
):
  """Final-normed hidden states [B, T, D] in the compute dtype; with `routing`, a pair of
  them and the mixture of experts' `Routing` of every layer (probs [B, T, L, E], experts
  [B, T, L, k]; None for a dense model).

  tokens int [B, T]; positions [B, T] (default arange); attention_mask [B, T] (1 / True for a
  real token, 0 for padding; combined with the causal mask). remat: recompute each layer in
  the backward pass instead of storing its activations. split_tokens: on a mesh, pins the
  residual stream's rows to devices where it enters each layer (`jetrl.parallel`'s
  `Layout.token_split`; the same values, computed per device). plan: the kernels
  (`jetrl.kernels.resolve_plan`; default: resolved for the precision now).
  """
  _check_config(config)
  check_params(params, config)
  _check_tokens("tokens", tokens)
  b, t = tokens.shape
  _check_like("positions", positions, (b, t))
  _check_like("attention_mask", attention_mask, (b, t))
  cd = activation_dtype(precision, params)
  plan = plan_for(precision, plan)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  cos, sin = rope_tables(config, positions, cd)
  flash = (attention_mask,) if plan.use_flash(t, config.head_dim, cd) else None
  allowed = None if flash else attn.causal_mask(attention_mask, b, t)

  split = split_tokens or (lambda a: a)

  def body(x, layer):
    return _layer(split(x), layer, config, plan, cd, cos, sin, allowed, flash)

  if remat:
    body = jax.checkpoint(body)
  x, routes = jax.lax.scan(body, split(_embed(params, tokens, cd)), params["layers"])
  x = split(x)
  chex.assert_shape(x, (b, t, config.d_model))
  h = plan.norm(x, params["final_norm"], config.rms_eps, cd)
  if not routing:
    return h
  if routes is not None:  # [L, B, T, ...] -> [B, T, L, ...]
    routes = Routing(*(jnp.moveaxis(a, 0, 2) for a in routes))
  return h, routes


def forward(params, config: ModelConfig, tokens: jax.Array, **inputs) -> jax.Array:
  """float32 logits [B, T, V]. `inputs` are `hidden_states`' keyword arguments (precision,
  positions, attention_mask, remat, plan), passed on as they are."""
  precision = inputs.get("precision")
  plan = inputs["plan"] = plan_for(precision, inputs.get("plan"))
  h = hidden_states(params, config, tokens, **inputs)
  return lm_head(h, params, config, activation_dtype(precision, params), plan)


def _check_cached(params, config, tokens, cache, positions, token_mask, attend_slots, plan):
  """forward_cached's arguments checked (its doc); returns the slots attention reads."""
  _check_config(config)
  check_params(params, config, allow_unstacked=True)
  _check_tokens("tokens", tokens)
  b, t = tokens.shape
  _check_like("positions", positions, (b, t))
  _check_like("token_mask", token_mask, (b, t))
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache must be a KVCache from init_cache, got {type(cache).__name__}")
  if not (
    isinstance(cache.k, tuple)
    and isinstance(cache.v, tuple)
    and len(cache.k) == len(cache.v) == config.n_layers
  ):
    raise ValueError(
      f"cache.k / cache.v must be tuples of {config.n_layers} per-layer arrays "
      f"(init_cache builds them), got {type(cache.k).__name__} / "
      f"{type(cache.v).__name__}"
    )
  s = cache.mask.shape[-1]
  expected = (b, config.n_kv_heads, s, config.head_dim)
  for name, layers in (("k", cache.k), ("v", cache.v)):
    for i, a in enumerate(layers):
      if tuple(a.shape) != expected:
        raise ValueError(
          f"cache.{name}[{i}] must have shape {expected} (B, Hkv, S, Dh) for "
          f"this config, batch and mask, got {tuple(a.shape)}"
        )
  if cache.v_exp and not (
    isinstance(cache.v_exp, tuple)
    and len(cache.v_exp) == config.n_layers
    and all(tuple(a.shape) == expected[:-1] + (1,) for a in cache.v_exp)
  ):
    raise ValueError(
      f"cache.v_exp must be empty or a tuple of {config.n_layers} per-layer "
      f"arrays of shape {expected[:-1] + (1,)} (init_cache builds them)"
    )
  if cache.v_exp and not plan.grids_cache:
    raise ValueError(
      "cache.v_exp is set (a gridded cache for a batch-invariant precision), "
      "but the precision is not batch-invariant or keeps an FP8 KV cache"
    )
  _check_fp8_cache(cache, config, plan, expected)
  if tuple(cache.mask.shape) != (b, s):
    raise ValueError(f"cache.mask must have shape {(b, s)}, got {tuple(cache.mask.shape)}")
  if t > s:
    raise ValueError(f"{t} new tokens do not fit in a cache of {s} slots")
  n = s if attend_slots is None else int(attend_slots)
  if not t <= n <= s:
    raise ValueError(
      f"attend_slots must be between the {t} new tokens and the cache's {s} "
      f"slots, got {attend_slots}"
    )
  return n


def _check_fp8_cache(cache, config, plan, expected) -> None:
  """An FP8 KV cache (E4M3 k / v with k_scale / v_scale) for a plan with one, a plain cache
  otherwise (init_cache builds either, from the precision)."""
  scales = expected[:-1] + (-(-config.head_dim // KV_BLOCK),)
  fp8 = plan.kv_fp8
  for name, layers in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
    want = config.n_layers if fp8 else 0
    if len(layers) != want or any(tuple(a.shape) != scales for a in layers):
      raise ValueError(
        f"cache.{name} must be "
        + (f"{want} per-layer arrays of shape {scales}" if fp8 else "empty")
        + f" for a precision with kv_cache={'fp8' if fp8 else 'compute'!r} (init_cache(..., "
        f"precision=...) builds it), got {len(layers)} arrays"
      )
  for name, layers in (("k", cache.k), ("v", cache.v)):
    if fp8 and any(a.dtype != KV_DTYPE for a in layers):
      raise ValueError(f"cache.{name} must hold {jnp.dtype(KV_DTYPE).name} values (FP8 KV cache)")


def forward_cached(
  params,
  config: ModelConfig,
  tokens: jax.Array,
  cache: KVCache,
  *,
  positions: jax.Array,
  token_mask: jax.Array,
  precision: Optional[Precision] = None,
  last_only: bool = False,
  attend_slots: Optional[int] = None,
  plan: Optional[Plan] = None,
  routing: bool = False,
):
  """Run T new tokens against the cache: (float32 logits [B, T, V], or [B, 1, V] with
  last_only; the new cache), and with `routing` the experts each new token's layers chose
  ([B, T, L, k] int32; None for a dense model).

  Writes the new k / v at slots [index, index + T), sets their mask from token_mask ([B, T],
  False for left padding), advances index by T (the caller keeps index + T <= max_len); each
  query attends to the set slots at or before its own; positions [B, T] are RoPE's.
  params["layers"] may be stacked or per-layer (`unstack_layers`: a decode loop slices once).
  A batch-invariant or FP8-cache precision wants its own cache (`init_cache(...,
  precision=...)`: gridded values, or E4M3 keys and values with scales, read dequantized as
  `forward` reads them). attend_slots: attention reads only the first `attend_slots` slots
  (none set past it, index + T <= it); the logits are those of the whole cache (bit for bit
  under a batch-invariant precision). plan: the kernels (default: resolved now); each layer's
  attention against the cache is its `CacheStep`'s (jetrl.kernels.cache_step).
  """
  plan = plan_for(precision, plan)
  n = _check_cached(params, config, tokens, cache, positions, token_mask, attend_slots, plan)
  t = tokens.shape[1]
  cd = activation_dtype(precision, params)
  index = jnp.asarray(cache.index, jnp.int32)
  mask = jax.lax.dynamic_update_slice(cache.mask, token_mask.astype(bool), (index * 0, index))
  step = plan.cache_step(cache, mask, index, t, n, cd)
  cos, sin = rope_tables(config, positions, cd)
  x = _embed(params, tokens, cd)
  # Unrolled over the per-layer caches, each updated in place (a scan would copy each out).
  layers = unstack_layers(params)["layers"]
  x, layers = step.layers(x, layers, config, cos, sin)  # those the fused decode kernels left
  chosen = []
  for i, layer in enumerate(layers):
    h = plan.norm(x, layer["attn_norm"], config.rms_eps, cd)
    if step.fuses_qkv(layer, config):  # the bias, RoPE, cache write and attention: one kernel
      out = step.attend_qkv(i, project(h, layer["wqkv"], plan, cd), layer, config, cos, sin)
    else:
      out = step.attend(i, *attn.qkv(h, layer, config, plan, cd, cos, sin))
    x = x + attn.output(out, layer, plan, cd)
    x, routes = _mlp_residual(x, layer, config, plan, cd)
    if routes is not None:
      chosen.append(routes.experts)
  if last_only:
    x = x[:, -1:, :]
  logits = lm_head(plan.norm(x, params["final_norm"], config.rms_eps, cd), params, config, cd, plan)
  k, v, *grids_and_scales = step.new_cache()
  cache = KVCache(k, v, mask, index + t, *grids_and_scales)
  if not routing:
    return logits, cache
  return logits, cache, jnp.stack(chosen, axis=2) if chosen else None
