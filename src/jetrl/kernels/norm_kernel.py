"""RMSNorm with both FP8 layouts of its output, in one Pallas kernel (a training step's producer).

In a training step the RMSNorm before q / k / v and before gate / up feeds a GEMM that reads its
output in 1 x 128 groups (fprop) and, in the backward, in 128 x 1 groups (wgrad). XLA writes the
norm in bf16 and two quantization kernels read it again. `norm_rows_cols` reads x once and
writes both layouts:

  rows: q [M, D], s_t [D/128, M]   the 1 x 128 groups, scales transposed (cuBLASLt's layout)
  cols: q_t [D, M], s [M/128, D]   the 128 x 1 groups, transposed

A program takes 128 rows: their statistics (float32 sums of squares over 128-column groups,
then `rsqrt(sum / D + eps)`), then each 128 x 128 tile normalised with `rms_norm_cd`'s rounding
points (bf16 after the scaling and after the weight) and quantized both ways. The sum runs in
another order than XLA's reduction, so a normalised value may differ from `rms_norm_cd`'s in its
last bf16 bit; every FP8 group is `quantize`'s of the bf16 value the kernel computed
(tests/precision/test_norm_kernel.py, interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.kernels import quant_kernel as _qk
from jetrl.kernels import partition

B = _qk.B


def rms_norm_cd(x, weight, eps: float, cd):
  """x / rms(x) * weight over the last axis: the statistic in float32, the output rounded to
  cd, then multiplied by the weight in cd (the model's RMSNorm, `models.layers.rms_norm`)."""
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  y = (x32 * jax.lax.rsqrt(var + eps)).astype(cd)
  return y * weight.astype(cd)


def _r(a, cd):
  return a.astype(cd).astype(jnp.float32)


def _kernel(
  x_ref, w_ref, q_ref, s_ref, qt_ref, sc_ref, *h_refs, groups, eps, cd, dtypes, interpret
):
  f32 = jnp.float32
  cols = [pl.ds(i * B, B) for i in range(groups)]
  total = jnp.zeros((x_ref.shape[0],), f32)
  for c in cols:
    x = x_ref[:, c].astype(f32)
    total = total + jnp.sum(x * x, axis=1)
  inv = jax.lax.rsqrt(total / f32(groups * B) + f32(eps))
  for i, c in enumerate(cols):
    w = _r(w_ref[c].astype(f32), cd)  # the weight in cd, as rms_norm_cd multiplies it
    h = _r(_r(x_ref[:, c].astype(f32) * inv[:, None], cd) * w[None, :], cd)
    q, s = _qk.quantize_groups(h, dtypes[0], interpret)
    q_ref[:, c] = q
    s_ref[pl.ds(i, 1), :] = s[None, :]
    q_t, s_c = _qk.quantize_col_groups(h, dtypes[1], interpret)
    qt_ref[c, :] = q_t
    sc_ref[:, c] = s_c[None, :]
    if h_refs:
      h_refs[0][:, c] = h.astype(h_refs[0].dtype)


def norm_rows_cols(
  x, weight, eps: float, cd, row_dtype, col_dtype, *, interpret: bool = False, values=False
):
  """((q, s_t), (q_t, s)) of rms_norm_cd(x, weight) for x [M, D], M and D multiples of 128
  (see the module doc); values=True also returns the bf16 norm output (tests)."""
  m, d = x.shape
  if x.ndim != 2 or m % B or d % B or weight.shape != (d,):
    raise ValueError(
      f"norm_rows_cols: x [M, D] with M and D multiples of {B} and weight [D]; got x "
      f"{x.shape}, weight {weight.shape}"
    )
  if values:
    outs = _local(x, weight, eps=eps, cd=cd, dtypes=(row_dtype, col_dtype), interpret=interpret,
                  values=True)  # fmt: skip
  else:
    names = tuple(jnp.dtype(t).name for t in (cd, row_dtype, col_dtype))
    outs = _partitioned(float(eps), names, interpret)(x, weight)
  pairs = ((outs[0], outs[1]), (outs[2], outs[3]))
  return pairs + (outs[4],) if values else pairs


@functools.lru_cache(maxsize=None)
def _partitioned(eps: float, names: tuple, interpret: bool):
  """The kernel sharded as x is on a mesh (jetrl.kernels.partition): whole 128-row groups
  per device, each row whole (its statistic needs every column)."""
  cd, row, col = (jnp.dtype(n) for n in names)
  fn = functools.partial(_local, eps=eps, cd=cd, dtypes=(row, col), interpret=interpret)

  def per_shard(chosen):
    if not chosen.get("d"):
      return fn
    # D split across devices (whole groups on each): each device's sum of squares is summed
    # across them, then its columns are normalised and quantized with the one-pass kernel
    return functools.partial(
      _split_d, axes=chosen["d"], eps=eps, cd=cd, dtypes=(row, col), interpret=interpret
    )

  return partition.sharded(
    fn,
    "m d, d -> m d, db m, d m, mb d",
    ties={"db": "d", "mb": "m"},
    block={"m": B, "d": B},
    per_shard=per_shard,
  )


def _split_d(x, weight, *, axes, eps, cd, dtypes, interpret: bool):
  """One device's columns of `norm_rows_cols`, D split over `axes`: the statistic summed across
  them (float32), the norm with `rms_norm_cd`'s rounding points, its groups quantized by
  `quant_kernel.quantize_both` (each 1 x 128 group lies inside the device's columns)."""
  x32 = x.astype(jnp.float32)
  d = x.shape[1] * jax.lax.psum(1, axes)
  total = jax.lax.psum(jnp.sum(x32 * x32, axis=1, keepdims=True), axes)
  h = (x32 * jax.lax.rsqrt(total / d + eps)).astype(cd) * weight.astype(cd)
  rows, cols = _qk.quantize_both(h, dtypes[0], dtypes[1], interpret=interpret)
  return rows + cols


def _local(x, weight, *, eps, cd, dtypes, interpret: bool, values: bool = False):
  m, d = x.shape
  rows = pl.BlockSpec((B, d), lambda i: (i, 0))
  out_shape = [
    jax.ShapeDtypeStruct((m, d), dtypes[0]),
    jax.ShapeDtypeStruct((d // B, m), jnp.float32),
    jax.ShapeDtypeStruct((d, m), dtypes[1]),
    jax.ShapeDtypeStruct((m // B, d), jnp.float32),
  ]
  out_specs = [
    rows,
    pl.BlockSpec((d // B, B), lambda i: (0, i)),
    pl.BlockSpec((d, B), lambda i: (0, i)),
    pl.BlockSpec((1, d), lambda i: (i, 0)),
  ]
  if values:
    out_shape.append(jax.ShapeDtypeStruct((m, d), cd))
    out_specs.append(rows)
  return pl.pallas_call(
    functools.partial(
      _kernel, groups=d // B, eps=float(eps), cd=cd, dtypes=dtypes, interpret=interpret
    ),
    out_shape=tuple(out_shape),
    grid=(m // B,),
    in_specs=[rows, pl.BlockSpec((d,), lambda i: (0,))],
    out_specs=tuple(out_specs),
    compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
    interpret=interpret,
    name="fp8_norm_rows_cols",
  )(x, weight)
