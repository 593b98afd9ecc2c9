"""The three FP8 GEMMs of `linear` as their numerics specify them, in XLA: quantize, dequantize
to float32, one float32 matmul (docs/numerics.md). This is the CPU emulation and the reference
the kernels (`jetrl.kernels`) are tested against: every kernel is handed the same FP8 values
and scales, so kernels differ from it only in the order of float32 sums.

`XlaGemms` is what `linear` computes its GEMMs with unless it is given another implementation
(a `jetrl.kernels.Plan`); its methods are the interface such an implementation provides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetrl.precision import exact as _exact
from jetrl.precision.formats import dot_precision, format_dtype
from jetrl.precision.quantize import dequantize, quantize
from jetrl.precision.weights import QuantizedInput, QuantizedWeight, weight_blocks

# A `QuantizedInput`'s groups: 1 x B along K.
B = 128


def matmul_f32(a: jax.Array, b: jax.Array, transpose_a=False, transpose_b=False):
  """a @ b (optionally transposed operands) with float32 accumulation and output."""
  ca = 0 if transpose_a else 1
  cb = 1 if transpose_b else 0
  return jax.lax.dot_general(
    a,
    b,
    (((ca,), (cb,)), ((), ())),
    precision=dot_precision(a, b),
    preferred_element_type=jnp.float32,
  )


def groups(g, shape, role: str):
  """Tile shape of a 2-D activation / gradient operand: "row" (1xB) or "col" (Bx1)."""
  if g.scaling == "tensor":
    return tuple(shape)
  return (1, g.block) if role == "row" else (g.block, 1)


def fake_quant(x: jax.Array, g, role: str, fmt: str) -> jax.Array:
  """Quantize then dequantize (float32) with the tiles of `role`."""
  block = groups(g, x.shape, role)
  q, s = quantize(x, block, format_dtype(fmt), g.pow2_scale)
  return dequantize(q, s, block)


def quant(x, g, role: str, fmt: str):
  """x's FP8 values and scales in the tiles of `role`."""
  return quantize(x, groups(g, x.shape, role), format_dtype(fmt), g.pow2_scale)


def fprop(x2: jax.Array, w: QuantizedWeight, g) -> jax.Array:
  """y [M, N] = x2 [M, K] @ w (already quantized), float32."""
  q, s = w.kn()
  return matmul_f32(fake_quant(x2, g, "row", g.fmt), dequantize(q, s, weight_blocks(g, q.shape)))


def fprop_quantized(x: QuantizedInput, w: QuantizedWeight) -> jax.Array:
  """`fprop` from x's 1 x 128 groups (`QuantizedInput`), float32: fake_quant(x) is
  dequantize(quantize(x)), the same product from the given groups."""
  xd = dequantize(x.q, x.scale_t.T, (1, B))
  q, s = w.kn()
  return matmul_f32(xd, dequantize(q, s, (B, B)))


def dgrad(dy2: jax.Array, w: QuantizedWeight, g) -> jax.Array:
  """dx [M, K] = dy2 [M, N] @ w^T with the forward's weight blocks, float32."""
  q, s = w.kn()
  wd = dequantize(q, s, weight_blocks(g, q.shape))
  return matmul_f32(fake_quant(dy2, g, "row", g.grad_fmt), wd, transpose_b=True)


def wgrad(x2: jax.Array, dy2: jax.Array, g) -> jax.Array:
  """dw [K, N] = x2^T @ dy2, contracting over tokens (Bx1 groups), float32."""
  xd = fake_quant(x2, g, "col", g.fmt)
  dyd = fake_quant(dy2, g, "col", g.grad_fmt)
  return matmul_f32(xd, dyd, transpose_a=True)


class XlaGemms:
  """`linear`'s GEMMs in XLA (stateless; one instance, `XLA`). Another implementation gives
  the same methods: the FP8 values and scales are `quantize`'s whatever computes them."""

  def k_major(self, g, exact: bool) -> bool:
    """Whether weights are quantized K-major for g's GEMMs (a kernel's layout; XLA's is not)."""
    del g, exact
    return False

  def matmul_cd(self, a, b, cd):
    """a @ b with float32 accumulation, rounded to the compute dtype cd."""
    return matmul_f32(a, b).astype(cd)

  def fprop(self, x2, w: QuantizedWeight, g, cd, exact: bool):
    """The FP8 forward GEMM from quantized weights (exact: the batch-invariant one)."""
    del cd
    if exact:  # exact float64 block sums in a fixed order (precision/exact.py)
      return _exact.fp8_fprop(x2, *w.kn(), g)
    return fprop(x2, w, g)

  def fprop_quantized(self, x: QuantizedInput, w: QuantizedWeight, g, cd):
    del cd
    if not (g.scaling == "block" and g.block == B):
      raise ValueError(
        f"linear: a QuantizedInput needs 1x128 block scaling, got {g.scaling} scaling, block "
        f"{g.block}"
      )
    return fprop_quantized(x, w)

  def dgrad(self, dy2, w: QuantizedWeight, g, cd):
    del cd
    return dgrad(dy2, w, g)

  def wgrad(self, x2, dy2, g, out_dtype):
    del out_dtype
    return wgrad(x2, dy2, g)


XLA = XlaGemms()
