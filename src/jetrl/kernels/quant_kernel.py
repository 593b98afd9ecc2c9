"""One pass over an activation: its 1x128 groups and its 128x1 groups, in a Pallas kernel.

wgrad needs an activation or gradient quantized in 128x1 groups (128 tokens x 1 channel),
fprop and dgrad need it in 1x128 groups; XLA computes each with a reduction fusion and an
elementwise fusion, reading the array twice per layout. `quantize_rows_cols` reads each
128 x 128 tile once and writes both:

  rows: q_row [M, K]  = quantize(x, (1, 128))[0],  s_row_t [K/128, M]  (its scales, transposed)
  cols: q_col_t [K, M] = quantize(x.T, (1, 128))[0], s_col_t [M/128, K]
        (x.T's 1x128 groups are x's 128x1 groups, so q_col_t is the transpose of x's 128x1
        quantization)

The scales come out transposed, in the layout the cuBLASLt GEMM reads (one row per 128-block,
rows of the operand contiguous). The arithmetic is `jetrl.precision.quantize`'s, operation for
operation (float32 amax, scale = amax * float32(1/FMAX), 1 for an all-zero group,
inv = 1 / scale correctly rounded, clip, round to nearest even), so the FP8 values and scales
are bit-identical to it: tested in interpret mode on the CPU and compiled on a GPU. Power-of-two
scales are not implemented here (`supported` says so; callers use `quantize` for them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.formats import fp8_max
from jetrl.kernels import partition

B = 128


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _scale(amax, fmax: float):
  s = amax * jnp.float32(np.float32(1.0) / np.float32(fmax))
  return jnp.where(s == 0, jnp.float32(1.0), s)


def _amax(ax, axis: int):
  """max |x| along `axis`, NaN if any is NaN (as `jetrl.precision.quantize.tile_amax`)."""
  return jnp.where(jnp.isnan(jnp.sum(ax, axis=axis)), jnp.float32(jnp.nan), jnp.max(ax, axis=axis))


# Triton lowers a float32 `/` to PTX's div.full.f32, which is not correctly rounded (up to 2
# ulp off); XLA's float32 division, which `quantize` uses, is (div.rn.f32). The compiled kernel
# therefore divides with div.rn.f32 itself, so that its 1 / scale, and with it every FP8 value,
# is the same as quantize's.
DIV_RN_F32 = "div.rn.f32 $0, $1, $2;"


def _reciprocal(s, interpret: bool):
  """1 / s, correctly rounded (IEEE), in the kernel."""
  one = jnp.ones_like(s)
  if interpret:  # jnp's division, IEEE on the CPU
    return one / s
  (inv,) = plgpu.elementwise_inline_asm(
    DIV_RN_F32,
    args=[one, s],
    constraints="=r,r,r",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)],
  )
  return inv


def quantize_groups(x, dtype, interpret: bool):
  """Inside a Pallas kernel: each row of x [R, 128] (float32) as one 1 x 128 group, with
  `quantize`'s arithmetic: (q [R, 128] in dtype, s [R] float32). The one place the kernels of
  this package and the model's fused decode kernels quantize."""
  fmax = fp8_max(dtype)
  s = _scale(_amax(jnp.abs(x), 1), fmax)
  inv = _reciprocal(s, interpret)
  return jnp.clip(x * inv[:, None], -fmax, fmax).astype(dtype), s


def emit_rows(x, q_ref, s_ref, dtype, interpret: bool) -> None:
  """Inside a kernel: x [R, 128] (float32, a tile's 1 x 128 groups) quantized to q_ref [R, 128]
  and its scales to s_ref [1, R] (the transposed layout cuBLASLt reads)."""
  q, s = quantize_groups(x, dtype, interpret)
  q_ref[...] = q
  s_ref[...] = s[None, :]


def quantize_col_groups(x, dtype, interpret: bool):
  """Inside a Pallas kernel: each column of x [128, C] (float32) as one 128 x 1 group, with
  `quantize`'s arithmetic: (q_t [C, 128] in dtype, the groups transposed; s [C] float32)."""
  fmax = fp8_max(dtype)
  s = _scale(_amax(jnp.abs(x), 0), fmax)
  inv = _reciprocal(s, interpret)
  return jnp.clip(x * inv[None, :], -fmax, fmax).astype(dtype).T, s


def emit_cols(x, q_ref, s_ref, dtype, interpret: bool) -> None:
  """Inside a kernel: x [128, C] (float32, a tile's 128 x 1 groups) quantized, transposed, to
  q_ref [C, 128] and its scales to s_ref [1, C]."""
  q_t, s = quantize_col_groups(x, dtype, interpret)
  q_ref[...] = q_t
  s_ref[...] = s[None, :]


def _kernel(x_ref, *out_refs, rows: bool, cols: bool, dtype, interpret: bool):
  x = x_ref[...].astype(jnp.float32)
  refs = list(out_refs)
  if rows:
    emit_rows(x, refs.pop(0), refs.pop(0), dtype, interpret)
  if cols:
    emit_cols(x, refs.pop(0), refs.pop(0), dtype, interpret)


def quantize_rows_cols(
  x: jax.Array, dtype, *, rows: bool = True, cols: bool = True, interpret: bool = False
):
  """(q_row, s_row_t) and / or (q_col_t, s_col_t) of a 2-D x (see the module doc), as a tuple
  of the requested pairs, rows first."""
  if x.ndim != 2:
    raise ValueError(f"quantize_rows_cols: x must be 2-D, got shape {x.shape}")
  if not (rows or cols):
    raise ValueError("quantize_rows_cols: ask for rows, cols or both")
  flat = _rows_cols_partitioned(jnp.dtype(dtype).name, rows, cols, interpret)(x)
  return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))


def quantize_both(x: jax.Array, row_dtype, col_dtype, *, interpret: bool = False):
  """((q_row, s_row_t), (q_col_t, s_col_t)) of a 2-D x: one pass over x where both layouts
  share a format, one pass for each otherwise."""
  if jnp.dtype(row_dtype) == jnp.dtype(col_dtype):
    rows, cols = quantize_rows_cols(x, row_dtype, interpret=interpret)
    return rows, cols
  (rows,) = quantize_rows_cols(x, row_dtype, cols=False, interpret=interpret)
  (cols,) = quantize_rows_cols(x, col_dtype, rows=False, interpret=interpret)
  return rows, cols


@functools.lru_cache(maxsize=None)
def _rows_cols_partitioned(dtype: str, rows: bool, cols: bool, interpret: bool):
  """`_rows_cols_local` sharded as x is on a mesh (jetrl.kernels.partition): 1 x 128 groups
  need whole groups of columns per device, 128 x 1 groups whole groups of rows."""
  outs = (["m k", "kb m"] if rows else []) + (["k m", "mb k"] if cols else [])
  fn = functools.partial(
    _rows_cols_local, dtype=jnp.dtype(dtype), rows=rows, cols=cols, interpret=interpret
  )
  block = {"k": B if rows else 1, "m": B if cols else 1}
  return partition.sharded(
    fn, "m k -> " + ", ".join(outs), ties={"kb": "k", "mb": "m"}, block=block
  )


def _rows_cols_local(x, *, dtype, rows: bool, cols: bool, interpret: bool):
  """`quantize_rows_cols` of one device's x, its pairs flattened."""
  m, k = x.shape
  mb, kb = _cdiv(m, B), _cdiv(k, B)
  xp = x if (m, k) == (mb * B, kb * B) else jnp.pad(x, ((0, mb * B - m), (0, kb * B - k)))
  out_shape, out_specs = [], []
  if rows:
    out_shape += [
      jax.ShapeDtypeStruct((mb * B, kb * B), dtype),
      jax.ShapeDtypeStruct((kb, mb * B), jnp.float32),
    ]
    out_specs += [
      pl.BlockSpec((B, B), lambda i, j: (i, j)),
      pl.BlockSpec((1, B), lambda i, j: (j, i)),
    ]
  if cols:
    out_shape += [
      jax.ShapeDtypeStruct((kb * B, mb * B), dtype),
      jax.ShapeDtypeStruct((mb, kb * B), jnp.float32),
    ]
    out_specs += [
      pl.BlockSpec((B, B), lambda i, j: (j, i)),
      pl.BlockSpec((1, B), lambda i, j: (i, j)),
    ]
  outs = pl.pallas_call(
    functools.partial(_kernel, rows=rows, cols=cols, dtype=dtype, interpret=interpret),
    out_shape=tuple(out_shape),
    grid=(mb, kb),
    in_specs=[pl.BlockSpec((B, B), lambda i, j: (i, j))],
    out_specs=tuple(out_specs),
    compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2),
    interpret=interpret,
    name="fp8_quantize_rows_cols",
  )(xp)
  result = []
  outs = list(outs)
  if rows:
    q, s = outs.pop(0), outs.pop(0)
    result += [q[:m, :k], s[:, :m]]
  if cols:
    q, s = outs.pop(0), outs.pop(0)
    result += [q[:k, :m], s[:, :k]]
  return tuple(result)


def row_block(m: int) -> int:
  """Rows a program of `quantize_rows_t` quantizes: the largest power of two up to B that
  divides m (0 when that is below 8: such an m is left to XLA's fusions)."""
  b = B
  while b >= 8:
    if m % b == 0:
      return b
    b //= 2
  return 0


def quantize_rows_t(x: jax.Array, dtype, *, interpret: bool = False):
  """(q [M, K], s_t [K/128, M]) of a 2-D x: `quantize(x, (1, 128))` with its scales written
  transposed (the layout cuBLASLt reads), in one kernel, for M a multiple of 8 and K of 128.

  XLA quantizes such an activation in three kernels (the amax reduction, the scale with its
  transpose, the scaled cast); this kernel reads x once and writes both, in programs of
  `row_block(M)` rows x 128 columns, so a decode step's few rows are not padded to 128.
  Bit-identical to `quantize` (the same `_kernel` as `quantize_rows_cols`)."""
  if x.ndim != 2:
    raise ValueError(f"quantize_rows_t: x must be 2-D, got shape {x.shape}")
  m, k = x.shape
  if not row_block(m) or k % B:
    raise ValueError(
      f"quantize_rows_t: needs rows a multiple of 8 and columns a multiple of {B}, got {x.shape}"
    )
  return _rows_t_partitioned(jnp.dtype(dtype).name, interpret)(x)


@functools.lru_cache(maxsize=None)
def _rows_t_partitioned(dtype: str, interpret: bool):
  """`_rows_t_local` sharded as x is on a mesh: whole groups of columns and rows in eights
  per device."""
  fn = functools.partial(_rows_t_local, dtype=jnp.dtype(dtype), interpret=interpret)
  return partition.sharded(fn, "m k -> m k, kb m", ties={"kb": "k"}, block={"k": B, "m": 8})


def _rows_t_local(x, *, dtype, interpret: bool):
  m, k = x.shape
  bm = row_block(m)
  return pl.pallas_call(
    functools.partial(_kernel, rows=True, cols=False, dtype=dtype, interpret=interpret),
    out_shape=(
      jax.ShapeDtypeStruct((m, k), dtype),
      jax.ShapeDtypeStruct((k // B, m), jnp.float32),
    ),
    grid=(m // bm, k // B),
    in_specs=[pl.BlockSpec((bm, B), lambda i, j: (i, j))],
    out_specs=(
      pl.BlockSpec((bm, B), lambda i, j: (i, j)),
      pl.BlockSpec((1, bm), lambda i, j: (j, i)),
    ),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="fp8_quantize_rows_t",
  )(x)
