"""Order-independent arithmetic for the `jet_exact` recipe: the batch-invariant FP8 GEMM and
exact fixed-point sums and dots in float64.

Why. XLA sums a dot or a reduction in an order that depends on the shapes of the program (a
decode step's 32 rows, a training forward's 4096, how a kernel tiles them), and float32
addition is not associative, so the same token's logits differ in their last bits between the
sampler and the training forward. Instead of fixing XLA's order, this module makes the order
irrelevant: every sum below is computed exactly, and an exact sum has one value whatever the
order, the tiling, the number of rows or the device (docs/numerics.md, "Bitwise on-policy").

FP8 GEMM. An E4M3 value is an integer multiple of 2^-9 of magnitude at most 448. The product
of two is a multiple of 2^-18 below 448^2 < 2^17.62, so it is exact in float32 (and float64),
and a sum of at most 128 of them is a multiple of 2^-18 below 2^24.62: 43 significant bits,
within float64's 53. Every partial sum of a 128-long block dot is therefore exact in float64,
in any order and with or without fused multiply-adds: the block dot has one value. What is
left is fixed by construction: each block's float64 dot is scaled by sx * sw (exact in
float64: two float32 factors), rounded to float32, and the K blocks are added in float32 in
the order kb = 0, 1, 2, ...; all of it elementwise over [M, N], so a row's result does not
depend on the other rows.

Fixed-point sums (`to_grid`, `exact_sum`). For operands that are not FP8 (attention, RMSNorm,
the LM head, softmax denominators) the same effect comes from rounding each term to a grid:
a vector's entries are rounded to integer multiples of 2^(e - bits), where 2^e bounds the
vector's largest magnitude, so they become integers of at most `bits` bits; integer sums
whose every partial sum stays below 2^53 are exact in float64. The grid depends on the
vector alone (its own largest entry, an order-free max), never on the batch. Entries smaller
than 2^-bits of the largest lose their low bits; `exact_sum` adds a second level that
carries those bits too.

Everything here is float64 inside `jax.enable_x64`, local to the function: results come back
as float32 (or the caller's dtype) and the rest of the program keeps 32-bit defaults.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jetrl.precision.formats import E4M3
from jetrl.precision.quantize import quantize

F64 = jnp.float64
# Float64 represents every integer of magnitude <= 2^53 exactly.
EXACT_BITS = 53
# exact_sum: at most MAX_SUM_TERMS terms per sum unless the caller bounds them tighter.
MAX_SUM_TERMS = 1 << 20
# fp8_fprop: about TILE_BYTES of float64 partial output rows at a time.
TILE_BYTES = 2 << 20


def x64():
  """The float64 context every function of this module computes in."""
  return jax.enable_x64(True)


def pow2(e: jax.Array) -> jax.Array:
  """float64 2^e for integer e (clamped to the normal range [-1022, 1023]), built from bits."""
  e = jnp.clip(e.astype(jnp.int64), -1022, 1023)
  return jax.lax.bitcast_convert_type((e + 1023) << 52, F64)


def exponent_bound(a: jax.Array) -> jax.Array:
  """int64 e with |a| < 2^e for float64 a (the frexp exponent, from the bits).

  0 and subnormals give a small e (so grids of an all-zero vector stay finite); Inf and NaN
  give a large one (their NaN / Inf still reaches the result through the values themselves).
  """
  bits = jax.lax.bitcast_convert_type(jnp.abs(a).astype(F64), jnp.int64)
  e = ((bits >> 52) & 0x7FF) - 1022
  return jnp.maximum(e, -900)


def to_grid(x: jax.Array, axis: int, bits: int):
  """Round x to integers n (|n| <= 2^bits) with x ~= n * 2^(e - bits).

  e (int, keepdims along `axis`) bounds the largest |x| over `axis`: entries within 2^-bits
  of the largest are exact, smaller ones are rounded (half to even) to the grid. bfloat16 and
  float32 x (bits <= 24) are handled in float32, where x * 2^(bits - e) and the integers n
  are exact (n comes back float32; a vector whose largest entry is below 2^(bits - 127) gets
  the grid of 2^(bits - 127), to keep the scale finite); anything else in float64.
  """
  if x.dtype in (jnp.bfloat16, jnp.float32) and bits <= 24:
    # The max in x's own dtype (exact): no float32 copy of a bfloat16 KV cache to read twice.
    top = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    if x.dtype == jnp.bfloat16:
      top = jax.lax.bitcast_convert_type(top, jnp.uint16).astype(jnp.int32) << 16
    else:
      top = jax.lax.bitcast_convert_type(top, jnp.int32)
    e = jnp.maximum(((top >> 23) & 0xFF) - 126, bits - 126)
    scale = jax.lax.bitcast_convert_type((bits - e + 127) << 23, jnp.float32)
    return jnp.round(x.astype(jnp.float32) * scale), e
  x = x.astype(F64)
  e = exponent_bound(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
  return jnp.round(x * pow2(bits - e)), e


def exact_sum(
  x: jax.Array, axis: int = -1, levels: int = 2, max_terms: int = MAX_SUM_TERMS
) -> jax.Array:
  """Sum of float64 x over `axis`, the same value whatever the order of the terms.

  Each term is rounded to the grid 2^(e - bits), where 2^e bounds the largest |term| and
  bits = 53 - log2(max_terms), so the integer sum is exact; with levels=2 the remainders are
  summed the same way on the grid 2^(e - 2 bits), and the result is the one rounded float64
  sum of the two. The error is at most max_terms * 2^-(bits + 1) (one level) or
  max_terms * 2^-(2 bits + 1) (two levels) of the largest term: 2^-22 and 2^-59 for
  max_terms = 2^16, 2^-14 and 2^-47 for 2^20. NaN / Inf propagate.
  """
  n = x.shape[axis]
  if n > max_terms:
    raise ValueError(
      f"exact_sum: {n} terms along axis {axis}; at most {max_terms} are summed exactly"
    )
  bits = EXACT_BITS - max(max_terms - 1, 0).bit_length()
  x = x.astype(F64)
  e = exponent_bound(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
  hi = jnp.round(x * pow2(bits - e))
  total = jnp.sum(hi, axis=axis) * pow2(jnp.squeeze(e, axis) - bits)
  if levels == 1:
    return total
  rest = x - hi * pow2(e - bits)  # exact: x minus its rounding to a coarser grid
  lo = jnp.round(rest * pow2(2 * bits - e))
  return total + jnp.sum(lo, axis=axis) * pow2(jnp.squeeze(e, axis) - 2 * bits)


def dot_bits(k: int) -> tuple[int, int]:
  """Grid bits (a, b) of two operands whose k-term integer dot is exact in float64."""
  total = EXACT_BITS - max(int(k) - 1, 0).bit_length()
  return total // 2, total - total // 2


def _row_tiles(m: int, n: int) -> int:
  """How many row tiles `fp8_fprop` computes an [m, n] output in: about m n 8 / TILE_BYTES,
  a divisor of m if one lies within 2x of that (no padding), 1 for small outputs."""
  need = -(-m * n * 8 // TILE_BYTES)
  if need < 2 or m < 16:
    return 1
  return next((d for d in range(need, min(2 * need, m) + 1) if m % d == 0), need)


def fp8_fprop(x2: jax.Array, q: jax.Array, s: jax.Array, g) -> jax.Array:
  """The batch-invariant FP8 forward GEMM: float32 [M, N] from x2 [M, K] and FP8 weights.

  x2 is quantized exactly as jet's fprop quantizes it (1 x block groups along K); q [K, N]
  and s are the weight's FP8 values and block scales (`quantize_weight`); g is the fprop's
  `Fp8Gemm` (block scaling, E4M3, blocks of at most 128). Per K block kb:
    t_kb = float32( dot64(xq[:, kb], q[kb, :]) * (float64(sx[:, kb]) * float64(sw[kb, :])) )
  and y = t_0 + t_1 + ... in float32, left to right.

  This is the specification, in XLA; on the CPU, `jetrl.kernels.exact_gemm.fp8_fprop` runs
  the same arithmetic as one kernel call where that kernel is available.
  """
  xq, sx = fp8_fprop_input(x2, q, s, g)
  return fp8_fprop_quantized(xq, sx, q, s, g)


def fp8_fprop_input(x2: jax.Array, q: jax.Array, s: jax.Array, g):
  """x2's FP8 values and scales as `fp8_fprop` quantizes them (the operands are checked)."""
  # Precision validates this for batch-invariant recipes; a direct call is checked here too.
  assert g.scaling == "block" and g.fmt == "e4m3" and g.block <= 128, g
  chex.assert_rank([x2, q, s], 2)
  b = g.block
  chex.assert_shape(s, (-(-x2.shape[1] // b), -(-q.shape[1] // b)))
  return quantize(x2, (1, b), E4M3, g.pow2_scale)


def fp8_fprop_quantized(xq: jax.Array, sx: jax.Array, q: jax.Array, s: jax.Array, g) -> jax.Array:
  """`fp8_fprop` from x2's FP8 values and scales (`fp8_fprop_input`)."""
  m, k = xq.shape
  n = q.shape[1]
  b = g.block
  nkb = -(-k // b)
  sw = jnp.repeat(s, b, axis=1, total_repeat_length=s.shape[1] * b)[:, :n]  # [nkb, N]
  # FP8 -> float32 is exact; float32 -> float64 too (XLA's direct FP8 -> float64 is slower).
  xf, wf = xq.astype(jnp.float32), q.astype(jnp.float32)

  blocks = [(kb * b, min((kb + 1) * b, k)) for kb in range(nkb)]
  with x64():  # the weight blocks and their scales in float64, once (not once per row tile)
    wd = [wf[lo:hi].astype(F64) for lo, hi in blocks]
    swd = sw.astype(F64)

  def rows(xf, sx):  # the rows of y from those rows of x and their scales
    acc = None
    with x64():
      for kb, (lo, hi) in enumerate(blocks):
        d = jax.lax.dot_general(
          xf[:, lo:hi].astype(F64), wd[kb], (((1,), (0,)), ((), ())), preferred_element_type=F64
        )
        scale = sx[:, kb].astype(F64)[:, None] * swd[kb][None, :]
        t = (d * scale).astype(jnp.float32)
        acc = t if acc is None else acc + t
    return acc

  # Each block dot writes a float64 partial of its rows; past a few MB the partials leave the
  # cache, so many rows go in tiles of about TILE_BYTES of partial each (a loop, not a larger
  # program). Tile j holds rows j, j + tiles, j + 2 tiles, ...: a row-sharded x splits each
  # tile the same way. Every element's arithmetic is the same whatever the tiling: it cannot
  # change a bit.
  tiles = _row_tiles(m, n)
  if tiles < 2:
    acc = rows(xf, sx)
  else:
    mp = -(-m // tiles) * tiles
    strided = lambda a: jnp.moveaxis(
      jnp.pad(a, ((0, mp - m), (0, 0))).reshape(mp // tiles, tiles, a.shape[1]), 1, 0
    )  # [tiles, rows per tile, ...]
    out = jax.lax.map(lambda a: rows(*a), (strided(xf), strided(sx)))
    acc = jnp.moveaxis(out, 0, 1).reshape(mp, n)[:m]
  chex.assert_shape(acc, (m, n))
  return acc
