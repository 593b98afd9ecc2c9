"""Building blocks of the decoder: RMSNorm, RoPE (with Llama-3 scaling), projections, SwiGLU.

Numerics: everything except the projections runs in the compute dtype `cd` (the precision's,
or the params' dtype when precision is None); reductions that need range (the RMS statistic,
RoPE angles) are taken in float32 and cast back.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import Plan
from jetrl.kernels.plan import plan_for
from jetrl.models.config import ModelConfig, RopeScaling
from jetrl.models.lora import LoraWeight, lora_linear
from jetrl.models.params import LM_HEAD_GRID
from jetrl.precision import Precision, QuantizedWeight
from jetrl.precision.formats import dtype_from_name

# What a layer computes under: a `jetrl.kernels.Plan`, or a precision (its plan resolved now).
Under = Union[Plan, Precision, None]


def activation_dtype(precision: Optional[Precision], params) -> jnp.dtype:
  """The dtype activations live in: the precision's compute dtype, else the params' dtype."""
  if precision is None:
    return jnp.dtype(params["embed"].dtype)
  return jnp.dtype(dtype_from_name(precision.compute_dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, cd, plan: Under = None) -> jax.Array:
  """x / rms(x) * weight over the last axis; the statistic in float32, the output in cd, by
  the plan's norm (`Plan.norm`; the batch-invariant plan's sums its squares exactly)."""
  return plan_for(plan).norm(x, weight, eps, cd)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] (float32), with Llama-3 scaling when given."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv
  old = float(scaling.original_max_position_embeddings)
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = (2 * math.pi / inv).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv / np.float32(scaling.factor), inv)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions: jax.Array, cd):
  """cos, sin [B, T, head_dim] in cd for integer positions [B, T] (angles in float32)."""
  inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
  # The halves' frequencies repeated: the same angles as concatenating [B, T, Dh/2] twice,
  # without a concatenation (on a GPU, one kernel for both tables instead of two).
  inv = jnp.asarray(np.concatenate([inv, inv]))
  angles = positions.astype(jnp.float32)[..., None] * inv  # [B, T, Dh]
  return jnp.cos(angles).astype(cd), jnp.sin(angles).astype(cd)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate x [B, T, H, Dh] (halves convention) by cos / sin [B, T, Dh]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def project(
  x: jax.Array, w: jax.Array, plan: Under, cd, bias: Optional[jax.Array] = None
) -> jax.Array:
  """x @ w through the plan's `linear` (`jetrl.precision.linear` on its kernels; a
  `LoraWeight`: its base there, plus its adapters, `lora.lora_linear`), plus an optional
  bias, in cd."""
  plan = plan_for(plan)
  if isinstance(w, LoraWeight):
    y = lora_linear(x, w, plan, cd)
  else:
    y = plan.linear(x, w).astype(cd)
  if bias is not None:
    y = y + bias.astype(cd)
  return y


def fusable(layer, parts, precision: Under) -> bool:
  """Whether the projections `parts` of `layer` (weights [..., D, N_i] reading the same x)
  can run as one GEMM on their weights concatenated along the output, with each part's
  values exactly as its own GEMM quantizes them: plain weights (not a LoRA run's adapters on
  a frozen base, not weights quantized once), and under FP8 block scaling in every GEMM of
  the precision (fprop, dgrad, wgrad) each part's width a multiple of the block, so that no
  weight tile and no group of an output gradient straddles two parts. One scale per tensor
  (`scaling="tensor"`) would change every part's scale: never fused."""
  if not all(p in layer for p in parts):
    return False
  if any(isinstance(layer[p], (LoraWeight, QuantizedWeight)) for p in parts):
    return False
  precision = precision.precision if isinstance(precision, Plan) else precision
  gemms = () if precision is None else (precision.fprop, precision.dgrad, precision.wgrad)
  for g in (g for g in gemms if g is not None):
    if g.scaling != "block" or any(layer[p].shape[-1] % g.block for p in parts):
      return False
  return True


def fused_weight(layer, fused: str, parts, precision: Under):
  """`layer[fused]` (a rollout's fused weight), else the parts' weights concatenated along
  the output where `fusable`, else None. Concatenated inside the differentiated forward, the
  parts' gradients are the fused gradient's slices: one GEMM for fprop, dgrad and wgrad where
  there were len(parts), and one quantization of x."""
  if fused in layer:
    return layer[fused]
  if fusable(layer, parts, precision):
    return jnp.concatenate([layer[p] for p in parts], axis=-1)
  return None


def swiglu(x: jax.Array, layer, plan: Under, cd) -> jax.Array:
  """down(silu(gate(x)) * up(x)); gate and up may come fused ("w_gate_up", a rollout's).
  The training forward keeps them apart (unlike q / k / v, `fused_weight`): compiled for an
  H200, the fused backward's gradient [M, 2F] is a concatenation that XLA cannot fuse with the
  recomputed silu(gate) * up, which costs more than the shared quantization of x saves
  (docs/benchmarks.md, 2026-12-06). Where the plan runs the MLP in its fused kernels
  (`Plan.fused_mlp`: a blockwise FP8 recipe compiled for a GPU) it is `Plan.mlp`: the same
  GEMMs, its FP8 groups written by SwiGLU's forward and backward kernels. A rollout's prefill
  there (gate / up fused, quantized once) takes h's groups from SwiGLU's kernel too
  (`Plan.swiglu_down`)."""
  plan = plan_for(plan)
  if "w_gate" in layer and "w_down" in layer:
    wg, wu, wd = layer["w_gate"], layer["w_up"], layer["w_down"]
    if plan.fused_mlp(math.prod(x.shape[:-1]), wg, wu, wd):
      return plan.mlp(x, wg, wu, wd)  # its quantization in its operators
  if "w_gate_up" in layer:
    gu = project(x, layer["w_gate_up"], plan, cd)
    y = plan.swiglu_down(gu, layer["w_down"], cd)
    if y is not None:
      return y
    gate, up = jnp.split(gu, 2, axis=-1)
  else:
    gate = project(x, layer["w_gate"], plan, cd)
    up = project(x, layer["w_up"], plan, cd)
  return project(jax.nn.silu(gate) * up, layer["w_down"], plan, cd)


def lm_head(h: jax.Array, params, config: ModelConfig, cd, plan: Under = None) -> jax.Array:
  """float32 logits [..., V] from hidden states [..., D]: not quantized, f32 accumulation, by
  the plan's head (`Plan.head`: on a GPU its 16-bit form, `jetrl.kernels.head.head_dot`; the
  batch-invariant plan's exact dots, from a rollout's gridded head where params have one)."""
  chex.assert_axis_dimension(h, -1, config.d_model)
  w = params["embed" if config.tie_embeddings else "lm_head"]
  return plan_for(plan).head(h, w, config.tie_embeddings, cd, params.get(LM_HEAD_GRID))
