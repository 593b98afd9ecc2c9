"""Building blocks of the decoder: RMSNorm, RoPE (with Llama-3 scaling), projections, SwiGLU.

Numerics: everything except the projections runs in the compute dtype `cd` (the precision's,
or the params' dtype when precision is None); reductions that need range (the RMS statistic,
RoPE angles) are taken in float32 and cast back.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import exact_ops
from jetrl.models.config import ModelConfig, RopeScaling
from jetrl.models.lora import LoraWeight, lora_linear
from jetrl.models.params import LM_HEAD_GRID
from jetrl.kernels.linear import linear
from jetrl.precision import Precision, QuantizedInput, QuantizedWeight
from jetrl.kernels import gemms as _gemms
from jetrl.kernels import mlp as _mlp
from jetrl.kernels import swiglu_kernel as _sk
from jetrl.kernels.norm_kernel import rms_norm_cd
from jetrl.precision import target as _target
from jetrl.precision.formats import dot_precision, dtype_from_name, format_dtype


def activation_dtype(precision: Optional[Precision], params) -> jnp.dtype:
  """The dtype activations live in: the precision's compute dtype, else the params' dtype."""
  if precision is None:
    return jnp.dtype(params["embed"].dtype)
  return jnp.dtype(dtype_from_name(precision.compute_dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, cd, exact: bool = False) -> jax.Array:
  """x / rms(x) * weight over the last axis; the statistic in float32, the output in cd.

  exact: the batch-invariant forward (exact sum of squares; models/exact_ops.py).
  """
  if exact:
    return exact_ops.rms_norm(x, weight, eps, cd, reference=rms_norm)
  return rms_norm_cd(x, weight, eps, cd)  # one formula with the fused kernels' backward


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
  x: jax.Array, w: jax.Array, precision: Optional[Precision], cd, bias: Optional[jax.Array] = None
) -> jax.Array:
  """x @ w through `jetrl.precision.linear` (a `LoraWeight`: its base there, plus its
  adapters, `lora.lora_linear`), plus an optional bias, in cd."""
  if isinstance(w, LoraWeight):
    y = lora_linear(x, w, precision, cd)
  else:
    y = linear(x, w, precision).astype(cd)
  if bias is not None:
    y = y + bias.astype(cd)
  return y


def fusable(layer, parts, precision: Optional[Precision]) -> bool:
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
  gemms = () if precision is None else (precision.fprop, precision.dgrad, precision.wgrad)
  for g in (g for g in gemms if g is not None):
    if g.scaling != "block" or any(layer[p].shape[-1] % g.block for p in parts):
      return False
  return True


def fused_weight(layer, fused: str, parts, precision: Optional[Precision]):
  """`layer[fused]` (a rollout's fused weight), else the parts' weights concatenated along
  the output where `fusable`, else None. Concatenated inside the differentiated forward, the
  parts' gradients are the fused gradient's slices: one GEMM for fprop, dgrad and wgrad where
  there were len(parts), and one quantization of x."""
  if fused in layer:
    return layer[fused]
  if fusable(layer, parts, precision):
    return jnp.concatenate([layer[p] for p in parts], axis=-1)
  return None


def swiglu(x: jax.Array, layer, precision: Optional[Precision], cd) -> jax.Array:
  """down(silu(gate(x)) * up(x)); gate and up may come fused ("w_gate_up", a rollout's).
  The training forward keeps them apart (unlike q / k / v, `fused_weight`): compiled for an
  H200, the fused backward's gradient [M, 2F] is a concatenation that XLA cannot fuse with the
  recomputed silu(gate) * up, which costs more than the shared quantization of x saves
  (docs/benchmarks.md, 2026-12-06). Under a blockwise FP8 recipe compiled for a GPU the MLP
  is `jetrl.kernels.mlp.swiglu_mlp`: the same GEMMs, its FP8 groups written by SwiGLU's
  forward and backward kernels. A rollout's prefill there (gate / up fused, quantized once)
  takes h's groups from SwiGLU's kernel too (`_quantized_swiglu_applies`)."""
  if "w_gate" in layer and "w_down" in layer:
    wg, wu, wd = layer["w_gate"], layer["w_up"], layer["w_down"]
    if _mlp.applies(math.prod(x.shape[:-1]), wg, wu, wd, precision):
      return _mlp.swiglu_mlp(x, wg, wu, wd, precision)  # its quantization in its operators
  if "w_gate_up" in layer:
    gu = project(x, layer["w_gate_up"], precision, cd)
    if _quantized_swiglu_applies(gu, layer["w_down"], precision, cd):
      lead, f2 = gu.shape[:-1], gu.shape[-1]
      hq = _sk.swiglu_gate_up_rows(
        gu.reshape(-1, f2), cd, format_dtype(precision.fprop.fmt), interpret=_target.interpreting()
      )  # h's 1 x 128 groups from gate and up, one kernel: no bf16 h, no quantization pass
      y = linear(QuantizedInput(*hq), layer["w_down"], precision).astype(cd)
      return y.reshape(*lead, y.shape[-1])
    gate, up = jnp.split(gu, 2, axis=-1)
  else:
    gate = project(x, layer["w_gate"], precision, cd)
    up = project(x, layer["w_up"], precision, cd)
  return project(jax.nn.silu(gate) * up, layer["w_down"], precision, cd)


def _quantized_swiglu_applies(gu, w_down, precision, cd) -> bool:
  """Whether a rollout's forward (gate / up fused, weights quantized once) of more rows than a
  decode step's writes h's FP8 groups in SwiGLU's kernel (`swiglu_kernel.swiglu_gate_up_rows`)
  for a down GEMM that takes them (`gemms.takes_quantized_input`): compiled for a GPU, 1 x 128
  block scaling, the fused MLP on (JETRL_FUSED_MLP), whole 128-row and 128-column tiles. The
  groups are bit for bit those the unfused path quantizes (tests/models/test_prefill_swiglu.py)."""
  if _target.platform() != "gpu" or not isinstance(precision, Precision):
    return False
  g = precision.fprop
  if g is None or precision.dgrad is not None or precision.batch_invariant:
    return False  # a QuantizedInput is a forward-only precision's (`linear`)
  if not isinstance(w_down, QuantizedWeight):
    return False
  m, f = math.prod(gu.shape[:-1]), gu.shape[-1] // 2
  if m <= _gemms.ONE_PASS_MAX_ROWS or m % _sk.B or f % _sk.B or w_down.shape[0] != f:
    return False
  if w_down.q.dtype != format_dtype(g.fmt) or not _mlp.fused_mlp_enabled():
    return False
  return _gemms.takes_quantized_input(g, m, w_down.shape[1], f, cd)


def lm_head(h: jax.Array, params, config: ModelConfig, cd, exact: bool = False) -> jax.Array:
  """float32 logits [..., V] from hidden states [..., D]: not quantized, f32 accumulation.

  exact: the batch-invariant forward (exact dots; models/exact_ops.py).
  """
  chex.assert_axis_dimension(h, -1, config.d_model)
  if exact:
    key = "embed" if config.tie_embeddings else "lm_head"
    reference = lambda a, w: lm_head(a, {key: w}, config, cd)
    if LM_HEAD_GRID in params:  # a rollout's weights, gridded once (rollout_weights)
      return exact_ops.lm_head_grids(
        h, params[LM_HEAD_GRID], config.tie_embeddings, cd, reference=reference
      )
    return exact_ops.lm_head(h, params[key], config.tie_embeddings, cd, reference=reference)
  if config.tie_embeddings:
    w, dims = params["embed"], (((h.ndim - 1,), (1,)), ((), ()))
  else:
    w, dims = params["lm_head"], (((h.ndim - 1,), (0,)), ((), ()))
  if _target.platform() == "gpu" and jnp.dtype(cd).itemsize == 2:
    return head_dot(h.astype(cd), w.astype(cd), config.tie_embeddings)
  return jax.lax.dot_general(
    h.astype(cd),
    w.astype(cd),
    dims,
    precision=dot_precision(cd),
    preferred_element_type=jnp.float32,
  )


def _head_dot(h, w, tied: bool):
  dims = (((h.ndim - 1,), (1 if tied else 0,)), ((), ()))
  return jax.lax.dot_general(
    h, w, dims, precision=dot_precision(h, w), preferred_element_type=jnp.float32
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_dot(h: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
  """float32 logits [..., V] of h [..., D] and the head w ([V, D] tied, [D, V] untied), both
  in the 16-bit compute dtype, with the backward's GEMMs in that dtype too.

  JAX's own transpose of a bf16 dot with a float32 result multiplies the float32 logit
  gradient: the two backward GEMMs (dh, dw), [tokens x 151936] for a Qwen vocabulary, then run
  in TF32, at half the bf16 rate on Hopper (docs/benchmarks.md, "Compiled programs"). Here the
  logit gradient is rounded to the compute dtype first (as `linear`'s custom VJP takes its
  bf16 output gradient) and both GEMMs accumulate in float32. `lm_head` takes this form when
  compiling for a GPU; on the CPU the float32 products cost no more, and are kept.
  """
  return _head_dot(h, w, tied)


def _head_dot_fwd(h, w, tied):
  return _head_dot(h, w, tied), (h, w)


def _head_dot_bwd(tied, res, g):
  h, w = res
  g = g.astype(h.dtype)
  f32 = jnp.float32
  lead = tuple(range(h.ndim - 1))  # the token axes
  last = h.ndim - 1
  if tied:  # logits = h . w^T, w [V, D]
    dh = jax.lax.dot_general(g, w, (((last,), (0,)), ((), ())), preferred_element_type=f32)
    dw = jax.lax.dot_general(g, h, ((lead, lead), ((), ())), preferred_element_type=f32)
  else:  # logits = h . w, w [D, V]
    dh = jax.lax.dot_general(g, w, (((last,), (1,)), ((), ())), preferred_element_type=f32)
    dw = jax.lax.dot_general(h, g, ((lead, lead), ((), ())), preferred_element_type=f32)
  return dh.astype(h.dtype), dw.astype(w.dtype)


head_dot.defvjp(_head_dot_fwd, _head_dot_bwd)
