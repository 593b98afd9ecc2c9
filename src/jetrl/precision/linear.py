"""`linear(x, w, precision)`: the one function every projection of the model calls.

FP8 GEMMs follow DESIGN.md:
  fprop  y  = x @ w     x in 1xB groups along K, w in BxB blocks
  dgrad  dx = dy @ w^T  dy in 1xB groups along N, the *same* BxB weight blocks as fprop
  wgrad  dw = x^T @ dy  x and dy in Bx1 groups (B tokens x 1 channel)
with float32 products and sums, and the compute dtype (bf16) between operators.

On this XLA path the scaled GEMM is written as dequantize-then-matmul in float32:
  sum_kb sx[:, kb] sw[kb, :] (xq[:, kb] @ wq[kb, :]) == deq(xq) @ deq(wq)
in exact arithmetic; in float32 the two agree to float32 rounding. The FP8 values and scales,
which is what the unified flow and batch invariance are about, are bit-exact by construction.

Each FP8 GEMM runs where its `Fp8Gemm.gemm_backend` says (jetrl.precision.backend): on an
FP8-capable GPU by default the blockwise FP8 Pallas kernel (jetrl.precision.gemm_pallas), which
takes the same FP8 values and scales and feeds them to the tensor cores as FP8.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jetrl.precision import backend as _backend
from jetrl.precision import exact as _exact
from jetrl.precision import gemm_pallas as _gp
from jetrl.precision.formats import compute_dtype as _compute_dtype
from jetrl.precision.formats import format_dtype
from jetrl.precision.quantize import dequantize, quantize
from jetrl.precision.recipes import Fp8Gemm, Precision

_HI = jax.lax.Precision.HIGHEST


def _matmul_f32(a: jax.Array, b: jax.Array, transpose_a=False, transpose_b=False):
  """a @ b (optionally transposed operands) with float32 accumulation and output."""
  ca = 0 if transpose_a else 1
  cb = 1 if transpose_b else 0
  return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=_HI,
                             preferred_element_type=jnp.float32)


def _blocks(g: Fp8Gemm, shape, role: str):
  """Tile shape of a 2-D operand for its role in a GEMM."""
  if g.scaling == "tensor":
    return tuple(shape)
  b = g.block
  return {"row": (1, b), "col": (b, 1), "weight": (b, b)}[role]


def _fake(x: jax.Array, g: Fp8Gemm, role: str, fmt: str) -> jax.Array:
  """Quantize then dequantize (float32) with the tiles of `role`."""
  block = _blocks(g, x.shape, role)
  q, s = quantize(x, block, format_dtype(fmt), g.pow2_scale)
  return dequantize(q, s, block)


def quantize_weight(w: jax.Array, g: Fp8Gemm):
  """FP8 weight blocks (q, scale, block) from the stored weight values."""
  block = _blocks(g, w.shape, "weight")
  q, s = quantize(w, block, format_dtype(g.fmt), g.pow2_scale)
  return q, s, block


def _same_weight_quant(a: Fp8Gemm, b: Fp8Gemm) -> bool:
  return (a.scaling, a.block, a.fmt, a.pow2_scale) == (b.scaling, b.block, b.fmt, b.pow2_scale)


class QuantizedWeight(NamedTuple):
  """A weight already quantized with an fprop's own quantizer (`quantize_weight`).

  `linear` accepts it in place of the weight for forward-only use (the rollout): the sampler
  quantizes each weight once per rollout instead of once per decode step. The FP8 values and
  scales are those the training fprop computes from the same stored weights, so outputs are
  bit-identical. Leading axes (e.g. stacked layers) slice like the weight's.
  """
  q: jax.Array       # FP8 values, the weight's shape
  scale: jax.Array   # float32 block scales

  @property
  def shape(self):
    return self.q.shape

  @property
  def ndim(self):
    return self.q.ndim


def prequantize_weight(w: jax.Array, g: Fp8Gemm) -> QuantizedWeight:
  """QuantizedWeight of `w` [..., K, N] (leading axes are mapped over)."""
  fn = lambda a: QuantizedWeight(*quantize_weight(a, g)[:2])
  for _ in range(w.ndim - 2):
    fn = jax.vmap(fn)
  return fn(w)


def _fprop(x2, q, s, g: Fp8Gemm, cd, w_shape, exact: bool = False):
  """The FP8 forward GEMM from quantized weights: one function for training and rollout."""
  if exact:  # batch-invariant: exact float64 block sums in a fixed order (precision/exact.py)
    return _exact.fp8_fprop(x2, q, s, g)
  kern = _kernel(g)
  if kern is not None:
    return _gp.fprop(x2, q, s, g, cd, **kern)
  xd = _fake(x2, g, "row", g.fmt)
  return _matmul_f32(xd, dequantize(q, s, _blocks(g, w_shape, "weight")))


def _kernel(g: Fp8Gemm):
  """None for the XLA path, else {"interpret": bool} for the Pallas kernel."""
  name = _backend.resolve(g)
  return None if name == "xla" else {"interpret": name == "pallas_interpret"}


def _check(x: jax.Array, w: jax.Array):
  if w.ndim != 2:
    raise ValueError(f"linear: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"linear: x [..., K] and w [K, N] must share K; got x {x.shape} and w {w.shape}")


def linear(x: jax.Array, w: jax.Array, precision: Optional[Precision] = None) -> jax.Array:
  """y = x @ w under `precision` (a recipe's `.train` or `.rollout`), differentiable.

  x: [..., K]; w: [K, N]. Returns [..., N] in the precision's compute dtype.
  precision=None: a plain matmul in the operands' own dtypes.
  """
  _check(x, w)
  if isinstance(w, QuantizedWeight):
    return _linear_prequantized(x, w, precision)
  if precision is None:
    return jnp.matmul(x, w, precision=_HI)  # no TF32: an exact float32 model on GPUs too
  if not isinstance(precision, Precision):
    raise TypeError(
        f"linear: precision must be a jetrl.precision.Precision or None, got {type(precision)}")
  cd = _compute_dtype(precision.compute_dtype)
  if not precision.is_fp8:
    lead = x.shape[:-1]
    y = _matmul_f32(x.reshape(-1, x.shape[-1]).astype(cd), w.astype(cd))
    return y.astype(cd).reshape(*lead, w.shape[1])
  # The cast's own VJP returns dx in x's dtype; inside, activations are in the compute dtype.
  return _fp8_linear(x.astype(cd), w, precision)


def _linear_prequantized(x, w: QuantizedWeight, precision: Optional[Precision]):
  if not isinstance(precision, Precision) or precision.fprop is None:
    raise ValueError("linear: a QuantizedWeight needs a precision with an FP8 fprop (the one "
                     f"it was quantized with), got {precision!r}")
  g = precision.fprop
  if w.q.dtype != format_dtype(g.fmt):
    raise ValueError(f"linear: QuantizedWeight has dtype {w.q.dtype}, but the precision's fprop "
                     f"quantizes weights to {g.fmt}")
  cd = _compute_dtype(precision.compute_dtype)
  lead, k, n = x.shape[:-1], x.shape[-1], w.shape[1]
  y = _fprop(x.reshape(-1, k).astype(cd), w.q, w.scale, g, cd, w.shape,
             precision.batch_invariant)
  return jax.lax.stop_gradient(y.astype(cd).reshape(*lead, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_linear(x, w, precision):
  return _fwd(x, w, precision)[0]


def _fwd(x, w, precision: Precision):
  cd = _compute_dtype(precision.compute_dtype)
  lead, k, n = x.shape[:-1], x.shape[-1], w.shape[1]
  x2 = x.reshape(-1, k).astype(cd)
  g = precision.fprop
  if g is None:
    y = _matmul_f32(x2, w.astype(cd))
    wq = None
  else:
    q, s, _ = quantize_weight(w, g)
    wq = (q, s)
    y = _fprop(x2, q, s, g, cd, w.shape, precision.batch_invariant)
  y = y.astype(cd).reshape(*lead, n)
  return y, (x2, w, wq)


def _bwd(precision: Precision, res, dy):
  x2, w, wq = res
  cd = _compute_dtype(precision.compute_dtype)
  x_shape = dy.shape[:-1] + (w.shape[0],)
  dy2 = dy.reshape(-1, w.shape[1]).astype(cd)

  g = precision.dgrad
  if g is None:
    dx = _matmul_f32(dy2, w.astype(cd), transpose_b=True)
  else:
    if wq is None or not _same_weight_quant(g, precision.fprop):
      wq = quantize_weight(w, g)[:2]
    kern = _kernel(g)
    if kern is not None:
      dx = _gp.dgrad(dy2, *wq, g, cd, **kern)
    else:
      wd = dequantize(*wq, _blocks(g, w.shape, "weight"))
      dyd = _fake(dy2, g, "row", g.grad_fmt)
      dx = _matmul_f32(dyd, wd, transpose_b=True)
  # The compute dtype (bf16) between operators.
  dx = dx.astype(cd).reshape(x_shape)

  g = precision.wgrad
  kern = None if g is None else _kernel(g)
  if g is None:
    dw = _matmul_f32(x2, dy2, transpose_a=True)
  elif kern is not None:
    dw = _gp.wgrad(x2, dy2, g, w.dtype, **kern)
  else:
    xd = _fake(x2, g, "col", g.fmt)
    dyd = _fake(dy2, g, "col", g.grad_fmt)
    dw = _matmul_f32(xd, dyd, transpose_a=True)
  dw = dw.astype(w.dtype)
  return dx, dw


_fp8_linear.defvjp(_fwd, _bwd)
