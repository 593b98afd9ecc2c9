"""Tile-wise FP8 quantization, exactly as docs/numerics.md specifies.

A tile is a block of `block[i]` consecutive entries along each axis i, aligned at index 0;
a tile at the high end of an axis may be partial. Each tile gets one float32 scale:

  amax  = max |x| over the tile (x cast to float32)
  scale = amax * float32(1 / FMAX)        (1 for an all-zero tile; the next power of two
                                            at or above it with `pow2_scale`)
  q     = cast(clip(x * float32(1 / scale), -FMAX, FMAX))   (round to nearest even)

NaN or Inf anywhere in a tile makes that tile's scale non-finite, so the dequantized tile is
non-finite too: bad values are never turned into finite garbage.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.precision.formats import E4M3, fp8_max


def _check_block(shape: tuple[int, ...], block: Sequence[int]) -> tuple[int, ...]:
  block = tuple(int(b) for b in block)
  if len(block) != len(shape):
    raise ValueError(f"block {block} must have one entry per axis of x (x has shape {shape})")
  if any(b < 1 for b in block):
    raise ValueError(f"block entries must be positive integers, got {block}")
  return block


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
  """Shape of the scale array: ceil(shape / block) per axis."""
  return tuple(-(-int(s) // int(b)) for s, b in zip(shape, block))


def _pad_to_tiles(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  pads = [(0, (-s) % b) for s, b in zip(x.shape, block)]
  if any(p[1] for p in pads):
    # Zeros never raise max|x| (and NaN still propagates), so padding does not take part.
    x = jnp.pad(x, pads)
  return x


def _tiled(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """[n0*b0, n1*b1, ...] -> [n0, b0, n1, b1, ...]."""
  new_shape = []
  for s, b in zip(x.shape, block):
    new_shape += [s // b, b]
  return x.reshape(new_shape)


def _expand(scale_like: jax.Array, block: tuple[int, ...]) -> jax.Array:
  """[n0, n1, ...] -> [n0, 1, n1, 1, ...] for broadcasting against a tiled array."""
  shape = []
  for n in scale_like.shape:
    shape += [n, 1]
  return scale_like.reshape(shape)


def _pow2_ceil(v: jax.Array) -> jax.Array:
  """Smallest power of two >= v, for finite v > 0 (float32)."""
  mant, expo = jnp.frexp(v)  # v = mant * 2**expo, mant in [0.5, 1)
  expo = jnp.where(mant == 0.5, expo - 1, expo)
  return jnp.ldexp(jnp.ones_like(v), expo)


def cast_to_fp8(x: jax.Array, dtype) -> jax.Array:
  """Round float32 values in [-FMAX, FMAX] (or NaN) to an FP8 dtype, nearest even.

  Bit-identical to `x.astype(dtype)` (tested exhaustively around every FP8 value). In a
  program compiled for the CPU it is written with integer ops on the float32 bits (XLA's CPU
  convert to FP8 is several times slower); for any other platform it is the native convert
  (one instruction per two values on Hopper). Which one is decided when the program is
  lowered, for the platform it is lowered for (`jax.lax.platform_dependent`): no argument and
  no global state says it. The result is a real FP8 array.
  """
  x = x.astype(jnp.float32)
  return jax.lax.platform_dependent(
    x, cpu=lambda v: _cast_bits(v, dtype), default=lambda v: v.astype(dtype)
  )


def _cast_bits(x: jax.Array, dtype) -> jax.Array:
  """`cast_to_fp8` with integer ops on the float32 bits (the CPU's)."""
  if np.dtype(dtype) == np.dtype(E4M3):
    mbits, bias, nan_code = 3, 7, 0x7F
  else:  # E5M2 (fp8_max has already rejected anything else)
    mbits, bias, nan_code = 2, 15, 0x7E
  shift = 23 - mbits
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  sign = (bits >> 31).astype(jnp.uint8) << 7
  mag = bits & jnp.uint32(0x7FFFFFFF)
  # Round the float32 mantissa to `mbits` bits, ties to even (a carry bumps the exponent).
  rounded = mag + jnp.uint32((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)
  rounded = rounded & jnp.uint32(0xFFFFFFFF ^ ((1 << shift) - 1))
  expo = (rounded >> 23).astype(jnp.int32) - 127 + bias
  normal = (expo << mbits) | ((rounded >> shift) & ((1 << mbits) - 1)).astype(jnp.int32)
  # Below the smallest normal the FP8 grid is uniform: round |x| / quantum to an integer.
  absx = jax.lax.bitcast_convert_type(mag, jnp.float32)
  subnormal = jnp.round(absx * jnp.float32(2.0 ** (bias - 1 + mbits))).astype(jnp.int32)
  code = jnp.where(expo >= 1, normal, subnormal)
  code = jnp.where(jnp.isnan(x), nan_code, code).astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(sign | code, dtype)


def tile_amax(ax: jax.Array, axes) -> jax.Array:
  """max over `axes` of |x| (given as `ax`), NaN when the tile holds a NaN.

  XLA's vectorized CPU reduction does not propagate NaN through `max` for every shape (a
  130 x 300 array kept a finite scale for a tile holding a NaN), so the NaN is carried by a sum,
  which always propagates it; XLA computes both in one reduction pass.
  """
  return jnp.where(jnp.isnan(jnp.sum(ax, axis=axes)), jnp.float32(jnp.nan), jnp.max(ax, axis=axes))


def compute_scale(amax: jax.Array, fmax: float, pow2_scale: bool = False) -> jax.Array:
  """Per-tile float32 scale from a float32 amax (see the module docstring)."""
  r = jnp.float32(np.float32(1.0) / np.float32(fmax))
  s = amax.astype(jnp.float32) * r
  if pow2_scale:
    finite_pos = jnp.isfinite(s) & (s > 0)
    s = jnp.where(finite_pos, _pow2_ceil(jnp.where(finite_pos, s, 1.0)), s)
  return jnp.where(s == 0, jnp.float32(1.0), s)


def quantize(
  x: jax.Array, block: Sequence[int], dtype=E4M3, pow2_scale: bool = False
) -> tuple[jax.Array, jax.Array]:
  """Quantize `x` to FP8 tile by tile.

  Args:
    x: any float array.
    block: tile shape, one entry per axis of x (e.g. (1, 128) for per-token groups,
      (128, 128) for weight blocks, x.shape for one per-tensor scale).
    dtype: jnp.float8_e4m3fn (E4M3) or jnp.float8_e5m2 (E5M2).
    pow2_scale: round each scale up to a power of two.

  Returns:
    (q, scale): q has x's shape and the FP8 dtype; scale is float32 with shape
    ceil(x.shape / block).
  """
  x = jnp.asarray(x)
  block = _check_block(x.shape, block)
  fmax = fp8_max(dtype)
  xf = x.astype(jnp.float32)
  xt = _tiled(_pad_to_tiles(xf, block), block)
  tile_axes = tuple(range(1, 2 * x.ndim, 2))
  amax = (
    tile_amax(jnp.abs(xt), tile_axes)
    if x.size
    else jnp.zeros(scale_shape(x.shape, block), jnp.float32)
  )
  scale = compute_scale(amax, fmax, pow2_scale)
  inv = jnp.float32(1.0) / scale
  qt = cast_to_fp8(jnp.clip(xt * _expand(inv, block), -fmax, fmax), dtype)
  q = qt.reshape(tuple(n * b for n, b in zip(scale.shape, block)))
  q = q[tuple(slice(0, s) for s in x.shape)]
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, block: Sequence[int]) -> jax.Array:
  """float32 values of a quantized array: q * scale, broadcast over each tile."""
  block = _check_block(q.shape, block)
  expected = scale_shape(q.shape, block)
  if tuple(scale.shape) != expected:
    raise ValueError(
      f"scale shape {tuple(scale.shape)} does not match q shape {q.shape} with block "
      f"{block}; expected {expected}"
    )
  return q.astype(jnp.float32) * expand_scale(scale, block, q.shape)


def expand_scale(scale: jax.Array, block: Sequence[int], shape: Sequence[int]) -> jax.Array:
  """Broadcast a per-tile scale to the full `shape` (float32)."""
  out = scale.astype(jnp.float32)
  for axis, (b, s) in enumerate(zip(block, shape)):
    if b > 1 and out.shape[axis] > 1:
      out = jnp.repeat(out, b, axis=axis, total_repeat_length=out.shape[axis] * b)
      out = jax.lax.slice_in_dim(out, 0, s, axis=axis)
  return out


def num_tiles(shape: Sequence[int], block: Sequence[int]) -> int:
  return math.prod(scale_shape(shape, block))


def quantize_rows_t(
  x: jax.Array, block: int, dtype=E4M3, pow2_scale: bool = False
) -> tuple[jax.Array, jax.Array]:
  """`quantize(x, (1, block))` of a 2-D x [M, K] with its scales transposed, [ceil(K/block),
  M]: the layout the cuBLASLt GEMM reads (`jetrl.kernels.cublaslt.gemm_t`).

  The same arithmetic operation for operation, so the same FP8 values and scales bit for bit;
  the amax is reduced in the transposed layout, so that XLA writes the scales where the GEMM
  reads them instead of transposing them in a kernel of their own (one kernel fewer per
  quantized activation: docs/benchmarks.md, "Compiled programs").
  """
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"quantize_rows_t: x must be 2-D, got shape {x.shape}")
  m, k = x.shape
  if x.size == 0:
    q, s = quantize(x, (1, block), dtype, pow2_scale)
    return q, s.T
  fmax = fp8_max(dtype)
  xf = _pad_to_tiles(x.astype(jnp.float32), (1, block))
  kb = xf.shape[1] // block
  xg = jnp.swapaxes(xf.reshape(m, kb, block), 0, 1)  # [K/b, M, b]
  scale_t = compute_scale(tile_amax(jnp.abs(xg), 2), fmax, pow2_scale)  # [K/b, M]
  inv_t = jnp.float32(1.0) / scale_t
  qg = cast_to_fp8(jnp.clip(xg * inv_t[:, :, None], -fmax, fmax), dtype)
  q = jnp.swapaxes(qg, 0, 1).reshape(m, kb * block)[:, :k]
  return q, scale_t
