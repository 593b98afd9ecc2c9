"""FP8 weights: a linear layer's weight quantized once, in the layout its GEMM reads.

A weight w [K, N] is quantized in BxB blocks (or with one scale, for per-tensor scaling). FP8
tensor cores read both operands contiguous along the contraction axis, so the GPU kernels
(cuBLASLt, Pallas) take the weight K-major: the FP8 values of w^T, [N, K]. Quantizing w^T with
transposed blocks gives exactly the transpose of quantizing w (the same tiles, the same amax,
the same elementwise cast), so the two layouts hold bit-identical FP8 values and scales.

`QuantizedWeight` is what the rollout passes to `linear` instead of the weight: quantized once
per rollout with the training fprop's own quantizer (docs/design.md, invariant "Same source
values"). Its `shape` is the logical weight shape [..., K, N] in either layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jetrl.precision.formats import format_dtype
from jetrl.precision.quantize import quantize


def weight_blocks(g, shape) -> tuple[int, int]:
  """Tile shape of a 2-D weight under an Fp8Gemm (BxB blocks, or the whole tensor)."""
  if g.scaling == "tensor":
    return tuple(shape)
  return (g.block, g.block)


def quantize_weight(w: jax.Array, g):
  """FP8 blocks of w [K, N]: (q [K, N], scale, block) from the stored weight values."""
  block = weight_blocks(g, w.shape)
  q, s = quantize(w, block, format_dtype(g.fmt), g.pow2_scale)
  return q, s, block


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=("q", "scale"),
  meta_fields=("k_major", "scale_pad"),
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A weight's FP8 values and block scales.

  q: [..., K, N] FP8, or [..., N, K] when k_major (the values of w^T).
  scale: float32 block scales, laid out like q's blocks ([..., ceil(K/B), ceil(N/B)], or
    transposed when k_major; [..., 1, 1] for one tensor scale), plus `scale_pad` columns.
  k_major: static. Leading axes (stacked layers) slice like the weight's.
  scale_pad: static; k_major only: columns of 1.0 after the scales' ceil(K/B), the padding
    of the leading dimension cuBLASLt reads them with (`gemms.with_gemm_scales`: done once
    for a rollout's weights instead of at every GEMM). `kn()` / `nk()` leave it out.
  """

  q: jax.Array
  scale: jax.Array
  k_major: bool = False
  scale_pad: int = 0

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical weight shape [..., K, N]."""
    s = tuple(self.q.shape)
    return s[:-2] + (s[-1], s[-2]) if self.k_major else s

  @property
  def ndim(self) -> int:
    return self.q.ndim

  def _scale(self) -> jax.Array:
    return (
      self.scale[..., : self.scale.shape[-1] - self.scale_pad] if self.scale_pad else self.scale
    )

  def kn(self) -> tuple[jax.Array, jax.Array]:
    """(q [K, N], scale) of a 2-D weight."""
    return (self.q.T, self._scale().T) if self.k_major else (self.q, self.scale)

  def nk(self) -> tuple[jax.Array, jax.Array]:
    """(q [N, K], scale) of a 2-D weight: the K-major layout the GPU kernels read."""
    return (self.q, self._scale()) if self.k_major else (self.q.T, self.scale.T)

  def nk_padded(self) -> tuple[jax.Array, jax.Array]:
    """`nk()` with the scales as stored, `scale_pad` columns included (cuBLASLt's)."""
    return (self.q, self.scale) if self.k_major else self.nk()


def quantize_2d(w: jax.Array, g, k_major: bool) -> QuantizedWeight:
  """QuantizedWeight of a 2-D weight w [K, N], in the requested layout."""
  if k_major:
    wt = w.T
    q, s = quantize(wt, weight_blocks(g, wt.shape), format_dtype(g.fmt), g.pow2_scale)
  else:
    q, s, _ = quantize_weight(w, g)
  return QuantizedWeight(q, s, k_major)


def prequantize_weight(w: jax.Array, g, *, k_major: bool = False) -> QuantizedWeight:
  """QuantizedWeight of `w` [..., K, N] (leading axes are mapped over)."""
  fn = lambda a: quantize_2d(a, g, k_major)
  for _ in range(w.ndim - 2):
    fn = jax.vmap(fn)
  return fn(w)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scale_t"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class QuantizedInput:
  """An activation already quantized in 1 x 128 groups, as `linear`'s fprop would quantize
  it: what a kernel that fuses the quantization into the operator before a projection (a
  decode step's RMSNorm, SwiGLU or attention, jetrl.kernels.decode_fused) hands to `linear`
  in place of x, so that no separate quantization kernel runs.

  q: [M, K] FP8 values; scale_t: [ceil(K/128), M] float32 scales, transposed (the layout
  cuBLASLt reads, `quant_kernel.quantize_rows_t`'s). The values and scales are those of
  `quantize(x, (1, 128))`, bit for bit, for the x they stand for.
  """

  q: jax.Array
  scale_t: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  @property
  def ndim(self) -> int:
    return self.q.ndim
