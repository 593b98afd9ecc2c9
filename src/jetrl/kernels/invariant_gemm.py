"""Batch-invariant GEMMs for GPUs (Pallas, lowered through Triton): `jet_exact`'s forward GEMMs
where a GPU computes them (`Plan`'s "invariant" blocks).

On the CPU `jet_exact` sums every FP8 block dot exactly in float64 (`jetrl.precision.exact`),
which makes the order of the sums irrelevant. A GPU's FP8 tensor cores cannot do that, so here
the order is fixed instead: an output element is computed by the same instruction sequence
whatever the number of rows around it.

  - one tile configuration (`TILES`: 64 x 128 output tiles, the 128-wide K block as the
    contraction tile, the same warps and pipelining depth) for every row count: a decode
    step's 8 rows, a prefill's 2,000 and a training forward's 16,000 run the same program on
    each tile, the rows padded with zeros to whole tiles;
  - no split-K or stream-K: one program owns an output tile and walks K itself;
  - the K blocks in order, kb = 0, 1, 2, ...: for the FP8 GEMM, block kb's dot of the FP8
    values (float32 result, the tensor cores' own accumulation within the block) times
    sx[:, kb] * sw[kb, :] added to a float32 accumulator, as docs/numerics.md specifies the
    FP8 forward GEMM; for the bf16 LM head, each block's dot added to the accumulator.

An output row then depends on its own input row alone: the other rows change nothing in its
arithmetic (tensor-core and interpret-mode dots compute each output element from its own row
and column; tests/precision/test_invariant_gemm.py checks row i against row i among 1, 7, 64
and 130 rows, other rows changed, in interpret mode). The FP8 values and scales are
`quantize`'s (1 x 128 groups of x, the weight's 128 x 128 blocks), so they are the training
fprop's and the rollout's alike. Against the CPU's exact sums the values differ by float32
rounding of the block dots: a GPU rollout matches the GPU training forward bit for bit, not
the CPU's.

Cost: rows are padded to a multiple of 64 (a decode step of 8 rows computes 64), where the
default tiles narrow to 16 rows for decode-sized GEMMs; the K loop is the default tiles' own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.kernels import gemm_pallas as _gp
from jetrl.precision.formats import E4M3
from jetrl.precision.quantize import quantize
from jetrl.precision.weights import QuantizedWeight

# The one tile configuration: every GEMM of the batch-invariant forward, every row count.
TILES = _gp.Tiles(bm=64, bn=128, num_warps=4, num_stages=4, group_m=8, fast_accum=True)
# The contraction tile of the 16-bit GEMM (the LM head): K blocks of this many, in order.
BK = 128


def fp8_fprop(x2: jax.Array, w: QuantizedWeight, g, out_dtype, *, interpret: bool) -> jax.Array:
  """y [M, N] = x2 [M, K] @ w under the fprop `g` (block scaling, E4M3, `jet_exact`'s), in
  `TILES` whatever M is. x2 is quantized in 1 x g.block groups as every fprop quantizes it;
  w is the weight quantized once (either layout: the kernel reads its K-major values)."""
  b = g.block
  xq, sx = quantize(x2, (1, b), E4M3, g.pow2_scale)
  q, s = w.nk()  # [N, K] FP8 and [ceil(N / b), ceil(K / b)] block scales
  n, nk = q.shape[0], sx.shape[1]
  sb = _gp._weight_scales_per_row(s, b, n, nk)  # pylint: disable=protected-access
  return _gp.scaled_matmul_nt(
    xq, sx, q, sb, block=b, out_dtype=out_dtype, interpret=interpret, tiles=TILES
  )


def _kernel16(a_ref, b_ref, o_ref, *, nk: int):
  """One output tile of a 16-bit GEMM: the K blocks' dots added in order, in float32."""
  bm, bn = o_ref.shape

  def body(kb, acc):
    start = pl.multiple_of(kb * BK, BK)
    a = a_ref[:, pl.ds(start, BK)]
    b = b_ref[:, pl.ds(start, BK)]
    part = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc + part

  o_ref[...] = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))


def matmul_nt(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
  """float32 out [P, Q] = a [P, C] @ b [Q, C]^T for 16-bit a and b (the LM head: hidden
  states and the vocabulary's rows), in `TILES`, K in blocks of BK in order. Zeros pad the
  rows, columns and K to whole tiles (a zero adds nothing; the padding of K depends on C
  alone, so every row sees the same one)."""
  (p, c), q = a.shape, b.shape[0]
  if b.shape[1] != c or a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize != 2:
    raise ValueError(
      f"matmul_nt: a [P, C] and b [Q, C] of one 16-bit dtype needed, got a {a.dtype}"
      f"{list(a.shape)}, b {b.dtype}{list(b.shape)}"
    )
  if p == 0 or q == 0:
    return jnp.zeros((p, q), jnp.float32)
  t = TILES
  cdiv = lambda n, d: -(-n // d)
  pp, qp, cp = cdiv(p, t.bm) * t.bm, cdiv(q, t.bn) * t.bn, max(1, cdiv(c, BK)) * BK
  a = jnp.pad(a, ((0, pp - p), (0, cp - c)))
  b = jnp.pad(b, ((0, qp - q), (0, cp - c)))
  out = pl.pallas_call(
    functools.partial(_kernel16, nk=cp // BK),
    out_shape=jax.ShapeDtypeStruct((pp, qp), jnp.float32),
    grid=(pp // t.bm, qp // t.bn),
    in_specs=[
      pl.BlockSpec((t.bm, cp), lambda i, j: (i, 0)),
      pl.BlockSpec((t.bn, cp), lambda i, j: (j, 0)),
    ],
    out_specs=pl.BlockSpec((t.bm, t.bn), lambda i, j: (i, j)),
    compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
    interpret=interpret,
    name="bf16_invariant_gemm",
  )(a, b)
  return out[:p, :q]
