"""Grouped-query attention's projections: q / k / v (one GEMM where they fuse), qk-norm, RoPE,
and the output projection. The attention itself (the masked float32 softmax, in the kernels a
`Plan` picks) is `jetrl.kernels.attention`'s.

Queries of kv-group g (heads g*G .. g*G+G-1, G = n_heads // n_kv_heads) share kv head g,
as in the Hugging Face checkpoints.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.kernels.attention import heads_first  # noqa: F401 (the cache's layout, re-exported)
from jetrl.kernels.plan import plan_for
from jetrl.models.config import ModelConfig
from jetrl.models.layers import Under, apply_rope, fused_weight, project


def qkv(
  x: jax.Array,
  layer,
  config: ModelConfig,
  plan: Under,
  cd,
  cos: jax.Array,
  sin: jax.Array,
):
  """q [B, T, H, Dh], k and v [B, T, Hkv, Dh] for x [B, T, D], with RoPE applied to q and k."""
  # One GEMM: a rollout's fused projection (jetrl.models.rollout_weights), or the three
  # weights concatenated where the precision allows (layers.fused_weight).
  plan = plan_for(plan)
  w = qkv_weight(layer, plan)
  if w is not None:
    return qkv_from(project(x, w, plan, cd), layer, config, plan, cd, cos, sin)
  q = project(x, layer["wq"], plan, cd, layer.get("bq"))
  k = project(x, layer["wk"], plan, cd, layer.get("bk"))
  v = project(x, layer["wv"], plan, cd, layer.get("bv"))
  return _heads(q, k, v, layer, config, plan, cd, cos, sin)


def qkv_weight(layer, precision: Under):
  """The q / k / v projections' one weight [D, q + 2 kv] where they run as one GEMM, else None."""
  return fused_weight(layer, "wqkv", ("wq", "wk", "wv"), precision)


def qkv_from(y, layer, config: ModelConfig, plan: Under, cd, cos, sin):
  """`qkv` from the one GEMM's output y [B, T, q + 2 kv] (`qkv_weight`)."""
  qd, kvd = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  q, k, v = y[..., :qd], y[..., qd : qd + kvd], y[..., qd + kvd :]
  if "bq" in layer:
    q, k, v = q + layer["bq"].astype(cd), k + layer["bk"].astype(cd), v + layer["bv"].astype(cd)
  return _heads(q, k, v, layer, config, plan_for(plan), cd, cos, sin)


def _heads(q, k, v, layer, config: ModelConfig, plan, cd, cos, sin):
  b, t, _ = q.shape
  q = q.reshape(b, t, config.n_heads, config.head_dim)
  k = k.reshape(b, t, config.n_kv_heads, config.head_dim)
  v = v.reshape(b, t, config.n_kv_heads, config.head_dim)
  if config.qk_norm:
    q = plan.norm(q, layer["q_norm"], config.rms_eps, cd)
    k = plan.norm(k, layer["k_norm"], config.rms_eps, cd)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def output(attn: jax.Array, layer, plan: Under, cd) -> jax.Array:
  """The o projection."""
  return project(attn, layer["wo"], plan, cd)


def causal_mask(attention_mask: Optional[jax.Array], b: int, t: int) -> jax.Array:
  """allowed [B, T, T]: key s <= query t, and key s is a real token when a mask is given."""
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
  if attention_mask is None:
    return jnp.broadcast_to(causal, (b, t, t))
  chex.assert_shape(attention_mask, (b, t))
  return causal & attention_mask.astype(bool)[:, None, :]
