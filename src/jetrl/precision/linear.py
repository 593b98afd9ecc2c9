"""`linear(x, w, precision)`: the FP8 GEMMs of one projection and their custom VJP.

FP8 GEMMs follow docs/numerics.md:
  fprop  y  = x @ w     x in 1xB groups along K, w in BxB blocks
  dgrad  dx = dy @ w^T  dy in 1xB groups along N, the *same* BxB weight blocks as fprop
  wgrad  dw = x^T @ dy  x and dy in Bx1 groups (B tokens x 1 channel)
with float32 products and sums, and the compute dtype (bf16) between operators.

The weight is quantized once per forward, in the layout its GEMM backend reads (K-major for
the GPU kernels; jetrl.precision.weights), and the same FP8 blocks serve dgrad. Each GEMM runs
on what `linear`'s `gemms` gives: the XLA reference by default (jetrl.precision.xla_gemms),
the kernels through a `jetrl.kernels.Plan` (`jetrl.kernels.linear`, what the model calls,
where `Fp8Gemm.gemm_backend` picks the kernel); on every backend the FP8 values and scales,
which is what the unified flow and batch invariance are about, are bit-identical.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jetrl.precision import xla_gemms as _xla
from jetrl.precision.formats import dtype_from_name
from jetrl.precision.formats import dot_precision, format_dtype
from jetrl.precision.recipes import Fp8Gemm, Precision
from jetrl.precision.weights import QuantizedInput, QuantizedWeight, quantize_2d


def _same_weight_quant(a: Fp8Gemm, b: Fp8Gemm) -> bool:
  return (a.scaling, a.block, a.fmt, a.pow2_scale) == (b.scaling, b.block, b.fmt, b.pow2_scale)


def _check(x: jax.Array, w):
  if w.ndim != 2:
    raise ValueError(f"linear: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(
      f"linear: x [..., K] and w [K, N] must share K; got x {x.shape} and w {w.shape}"
    )


def linear(x: jax.Array, w, precision: Optional[Precision] = None, gemms=None) -> jax.Array:
  """y = x @ w under `precision` (a recipe's `.train` or `.rollout`), differentiable.

  x: [..., K], or a `QuantizedInput` [M, K] (an activation its producer already quantized
    as the fprop would, with a `QuantizedWeight` under a forward-only precision: a decode
    step's fused kernels).
  w: [K, N], or a `QuantizedWeight` of it: a weight quantized once (the
    rollout's, forward only; a frozen LoRA base's under a training precision, whose backward
    gives dx from the same FP8 blocks and no weight gradient).
  Returns [..., N] in the precision's compute dtype.
  precision=None: a plain matmul in the operands' own dtypes.
  gemms: what computes the GEMMs (`xla_gemms.XlaGemms`'s methods): None, the XLA reference
    (`xla_gemms.XLA`); the kernels' is a `jetrl.kernels.Plan` (`jetrl.kernels.linear`). The
    FP8 values and scales are the same whatever computes them.
  """
  gemms = _xla.XLA if gemms is None else gemms
  if isinstance(x, QuantizedInput):
    return _linear_quantized_input(x, w, precision, gemms)
  _check(x, w)
  if isinstance(w, QuantizedWeight):
    return _linear_prequantized(x, w, precision, gemms)
  if precision is None:
    return jnp.matmul(x, w, precision=dot_precision(x, w))  # float32 models: no TF32
  if not isinstance(precision, Precision):
    raise TypeError(
      f"linear: precision must be a jetrl.precision.Precision or None, got {type(precision)}"
    )
  cd = dtype_from_name(precision.compute_dtype)
  # The cast's own VJP returns dx in x's dtype; inside, activations are in the compute dtype.
  # A recipe without FP8 GEMMs (bf16, fp32) takes the same custom VJP, whose dgrad and wgrad
  # multiply the compute-dtype gradient: JAX's own transpose of a bf16 dot with a float32
  # result would multiply float32 cotangents, a float32 (TF32) GEMM on a GPU at half the
  # bf16 rate, for the same values (bf16 x bf16 products are exact in float32).
  return _fp8_linear(x.astype(cd), w, precision, gemms)


def _linear_quantized_input(x: QuantizedInput, w, precision: Optional[Precision], gemms):
  """A rollout's forward from an activation its producer already quantized (a decode step's
  fused kernels): the fprop GEMM on those FP8 groups, no gradient."""
  if not (
    isinstance(w, QuantizedWeight)
    and isinstance(precision, Precision)
    and precision.fprop is not None
    and precision.dgrad is None
    and not precision.batch_invariant  # jet_exact sums exactly, from x itself
  ):
    raise ValueError(
      "linear: a QuantizedInput x needs a QuantizedWeight and a forward-only FP8 precision "
      f"that is not batch-invariant (a recipe's .rollout, not jet_exact's), got "
      f"{type(w).__name__} and {precision!r}"
    )
  if x.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"linear: x [M, K] and w [K, N] must share K; got x {x.shape}, w {w.shape}")
  cd = dtype_from_name(precision.compute_dtype)
  y = gemms.fprop_quantized(x, w, precision.fprop, cd)
  return jax.lax.stop_gradient(y.astype(cd))


def _linear_prequantized(x, w: QuantizedWeight, precision: Optional[Precision], gemms):
  if not isinstance(precision, Precision) or precision.fprop is None:
    raise ValueError(
      "linear: a QuantizedWeight needs a precision with an FP8 fprop (the one "
      f"it was quantized with), got {precision!r}"
    )
  g = precision.fprop
  if w.q.dtype != format_dtype(g.fmt):
    raise ValueError(
      f"linear: QuantizedWeight has dtype {w.q.dtype}, but the precision's fprop "
      f"quantizes weights to {g.fmt}"
    )
  cd = dtype_from_name(precision.compute_dtype)
  lead, k, n = x.shape[:-1], x.shape[-1], w.shape[1]
  x2 = x.reshape(-1, k).astype(cd)
  if precision.dgrad is None:  # a rollout's forward: no gradient to give
    y = gemms.fprop(x2, w, g, cd, precision.batch_invariant)
    return jax.lax.stop_gradient(y.astype(cd).reshape(*lead, n))
  if not _same_weight_quant(precision.dgrad, g):
    raise ValueError(
      "linear: a QuantizedWeight under a training precision needs a dgrad that quantizes "
      f"weights as its fprop does (the same blocks serve both), got fprop {g} and dgrad "
      f"{precision.dgrad}"
    )
  return _frozen_linear(x2, w, precision, gemms).reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _frozen_linear(x2, w: QuantizedWeight, precision: Precision, gemms):
  """y = x2 @ w for a frozen FP8 weight (quantized once, a LoRA base): the fprop's GEMM, and
  a backward that gives dx from the same FP8 blocks (dgrad) and no weight gradient."""
  cd = dtype_from_name(precision.compute_dtype)
  return gemms.fprop(x2, w, precision.fprop, cd, precision.batch_invariant).astype(cd)


def _frozen_fwd(x2, w, precision, gemms):
  return _frozen_linear(x2, w, precision, gemms), w


def _frozen_bwd(precision, gemms, w, dy):
  cd = dtype_from_name(precision.compute_dtype)
  dx = gemms.dgrad(dy.astype(cd), w, precision.dgrad, cd).astype(cd)
  return dx, jax.tree_util.tree_map(jnp.zeros_like, w)


_frozen_linear.defvjp(_frozen_fwd, _frozen_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_linear(x, w, precision, gemms):
  return _fwd(x, w, precision, gemms)[0]


def _fwd(x, w, precision: Precision, gemms):
  cd = dtype_from_name(precision.compute_dtype)
  lead, k, n = x.shape[:-1], x.shape[-1], w.shape[1]
  x2 = x.reshape(-1, k).astype(cd)
  g = precision.fprop
  if g is None:
    y = gemms.matmul_cd(x2, w.astype(cd), cd)
    wq = None
  else:
    wq = quantize_2d(w, g, gemms.k_major(g, precision.batch_invariant))
    y = gemms.fprop(x2, wq, g, cd, precision.batch_invariant)
  y = y.astype(cd).reshape(*lead, n)
  return y, (x2, w, wq)


def _bwd(precision: Precision, gemms, res, dy):
  x2, w, wq = res
  cd = dtype_from_name(precision.compute_dtype)
  x_shape = dy.shape[:-1] + (w.shape[0],)
  dy2 = dy.reshape(-1, w.shape[1]).astype(cd)

  g = precision.dgrad
  if g is None:
    dx = _xla.matmul_f32(dy2, w.astype(cd), transpose_b=True)
  else:
    if wq is None or not _same_weight_quant(g, precision.fprop):
      wq = quantize_2d(w, g, gemms.k_major(g, False))
    dx = gemms.dgrad(dy2, wq, g, cd)
  # The compute dtype (bf16) between operators.
  dx = dx.astype(cd).reshape(x_shape)

  g = precision.wgrad
  if g is None:
    dw = _xla.matmul_f32(x2, dy2, transpose_a=True)
    if not precision.is_fp8:  # as JAX's own transpose of the compute-dtype dot rounds it
      dw = dw.astype(cd)
  else:
    dw = gemms.wgrad(x2, dy2, g, w.dtype)
  return dx, dw.astype(w.dtype)


_fp8_linear.defvjp(_fwd, _bwd)
