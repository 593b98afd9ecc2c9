"""Blockwise-scaled FP8 GEMMs in one Pallas kernel (Triton on NVIDIA GPUs).

The kernel computes, for FP8 operands `a [P, C]`, `b [Q, C]` (both contiguous along the
contraction axis C, the layout FP8 tensor cores want) and float32 scales per contraction block:

  out[p, q] = sum_kb  sa[p, kb] * sb[q, kb] * (a[p, kb-block] . b[q, kb-block])

Each K-block's dot takes the FP8 tiles as they are (`preferred_element_type=float32`), its
float32 result is scaled inside the loop and added to a float32 accumulator, and the output is
cast once to the requested dtype. That one kernel serves the three GEMMs of `linear`
(docs/numerics.md), by what it is handed:

  fprop  y  = x @ w       a = x  (1xB groups along K),   b = w^T (BxB blocks -> per-row of b)
  dgrad  dx = dy @ w^T    a = dy (1xB groups along N),   b = w   (the same BxB blocks)
  wgrad  dw = x^T @ dy    a = x^T, b = dy^T, both in Bx1 groups over tokens (M is contracted)

The quantization is the jnp code of `jetrl.precision.quantize` (XLA fuses it with the transposes
and the padding), so the FP8 values and scales are bit-identical to the XLA path. In interpret
mode the results agree with the XLA path to float32 rounding; on a GPU, each block's 128-term
sum has the tensor cores' accumulation precision (below). Partial tiles are padded with zeros
in the wrapper (a zero never changes a sum) and the padded rows/columns are sliced off.

Accumulation: on Hopper, Triton runs an FP8 dot on the wgmma tensor cores only if it may let
the tensor core accumulate some products at its own (reduced) precision before adding them to
the float32 accumulator (`maxNumImpreciseAcc` >= 32); otherwise it falls back to the older
mma.sync path. Each K-block's dot (`block` = 128 products) is therefore emitted with
maxNumImpreciseAcc = block: the tensor cores sum one block, and the scale-and-add in float32
after it is the promotion step, every 128 products (the interval DeepSeek-V3 uses). The
Pallas lowering of `lax.dot_general` has no such knob, so the kernel's dot is a small primitive
with its own Triton lowering rule (`Tiles.fast_accum=False` uses plain `lax.dot_general`).

Mixed formats (E4M3 activations or weights with E5M2 gradients) are upcast to bf16 inside the
kernel before the dot: the Pallas Triton lowering accepts a dot only on equal element types, and
bf16 holds every E4M3 and E5M2 value exactly, so the result is the same; that GEMM then runs on
bf16 tensor cores (with FP8 loads). E4M3 gradients, the default, keep all three GEMMs in FP8.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jax_core
from jax.interpreters import mlir
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.formats import E4M3, E5M2, format_dtype
from jetrl.precision.quantize import quantize

_FP8 = (np.dtype(E4M3), np.dtype(E5M2))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pow2_at_least(n: int, lo: int) -> int:
  return max(lo, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Output tile (bm x bn), Triton warps per program, software-pipelining depth, how many row
  tiles run next to each other (grouped launch order, for L2 reuse of the b tiles), and whether
  the tensor cores may sum each K-block before the float32 promotion (see the module doc)."""

  bm: int = 128
  bn: int = 128
  num_warps: int = 8
  num_stages: int = 3
  group_m: int = 8
  fast_accum: bool = True

  def __post_init__(self):
    for name in ("bm", "bn"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")


def default_tiles(p: int, q: int) -> Tiles:
  """Tiles for an out[p, q] GEMM: 128x128 for large ones, narrower rows for decode-sized p."""
  bm = min(128, _pow2_at_least(p, 16))
  bn = min(128, _pow2_at_least(q, 16))
  # The float32 accumulator and one K-block's partial product both live in registers:
  # keep them at <= 128 registers per thread together (a 128x128 tile takes 8 warps).
  warps = max(4, min(8, bm * bn // 2048))
  return Tiles(bm=bm, bn=bn, num_warps=warps, num_stages=4 if bm * bn <= 64 * 128 else 3)


# --- One K-block's dot: a [m, k] . b [n, k]^T -> float32 [m, n] ------------------------------


def _block_dot_ref(a, b, *, max_imprecise: int):
  del max_imprecise  # XLA (interpret mode, CPU) computes the dot in float32.
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


_block_dot_p = jax_core.Primitive("fp8_block_dot")
_block_dot_p.def_impl(_block_dot_ref)
_block_dot_p.def_abstract_eval(
  lambda a, b, *, max_imprecise: jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)
)
mlir.register_lowering(_block_dot_p, mlir.lower_fun(_block_dot_ref, multiple_results=False))


def _register_triton_rule() -> Optional[str]:
  """Teach the Pallas Triton lowering to emit the dot with maxNumImpreciseAcc (private API:
  returns why not, and the kernel then uses lax.dot_general)."""
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir.dialects import arith  # pylint: disable=import-outside-toplevel
    from jax._src.pallas.triton import lowering as tl  # pylint: disable=import-outside-toplevel

    tt = tl.tt_dialect
    plain_rule = tl.triton_lowering_rules[lax.dot_general_p]
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"

  def rule(ctx, a, b, *, max_imprecise):
    try:
      m, n = ctx.avals_out[0].shape
      acc_t = ir.RankedTensorType.get([m, n], ir.F32Type.get())
      acc = arith.constant(
        acc_t, ir.DenseElementsAttr.get_splat(acc_t, ir.FloatAttr.get(ir.F32Type.get(), 0.0))
      )
      return tt.dot(a, tt.trans(b, (1, 0)), acc, max_num_imprecise_acc=max_imprecise)
    except Exception:  # pylint: disable=broad-except
      # A JAX whose Triton bindings differ: the plain FP8 dot (mma.sync on Hopper).
      return plain_rule(
        ctx,
        a,
        b,
        dimension_numbers=(((1,), (1,)), ((), ())),
        out_sharding=None,
        precision=None,
        preferred_element_type=jnp.float32,
      )

  tl.triton_lowering_rules[_block_dot_p] = rule
  return None


@functools.lru_cache(maxsize=None)
def fast_accum_unavailable() -> Optional[str]:
  """Registers the Triton rule on the kernel's first use; why it could not be, or None."""
  return _register_triton_rule()


def _block_dot(a, b, fast: bool, bk: int):
  if fast and a.dtype == b.dtype and np.dtype(a.dtype) in _FP8 and fast_accum_unavailable() is None:
    return _block_dot_p.bind(a, b, max_imprecise=bk)
  return _block_dot_ref(a, b, max_imprecise=0)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, nk: int, bk: int, upcast, fast: bool):
  """One bm x bn output tile: loop over the contraction blocks, scale each partial, add."""
  bm, bn = o_ref.shape

  def body(kb, acc):
    start = pl.multiple_of(kb * bk, bk)
    a = a_ref[:, pl.ds(start, bk)]
    b = b_ref[:, pl.ds(start, bk)]
    if upcast is not None:
      a, b = a.astype(upcast), b.astype(upcast)
    part = _block_dot(a, b, fast, bk)
    scale = sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]
    return acc + scale * part

  acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_ij(pid, n_p: int, n_q: int, group: int):
  """Program id -> (row tile, column tile), `group` row tiles at a time (grouped order)."""
  per_group = group * n_q
  first = lax.div(pid, per_group) * group
  size = jnp.minimum(n_p - first, group)
  within = lax.rem(pid, per_group)
  return first + lax.rem(within, size), lax.div(within, size)


def scaled_matmul_nt(
  a: jax.Array,
  sa: jax.Array,
  b: jax.Array,
  sb: jax.Array,
  *,
  block: int = 128,
  out_dtype=jnp.bfloat16,
  interpret: bool = False,
  tiles: Optional[Tiles] = None,
) -> jax.Array:
  """out [P, Q] = sum_kb sa[:, kb] sb[:, kb]^T * (a[:, kb] @ b[:, kb]^T), float32 inside.

  a: [P, C] and b: [Q, C], float8_e4m3fn or float8_e5m2. sa: [P, ceil(C / block)] and
  sb: [Q, ceil(C / block)], float32. block: the contraction block of the scales (and the
  kernel's K tile). interpret: run in Pallas interpret mode (CPU). tiles: None for
  `default_tiles(P, Q)`.
  """
  for name, v in (("a", a), ("b", b)):
    if v.ndim != 2 or np.dtype(v.dtype) not in _FP8:
      raise ValueError(
        f"scaled_matmul_nt: {name} must be a 2-D float8_e4m3fn or float8_e5m2 "
        f"array, got {v.dtype}{list(v.shape)}"
      )
  (p, c), q = a.shape, b.shape[0]
  if b.shape[1] != c:
    raise ValueError(f"scaled_matmul_nt: a {a.shape} and b {b.shape} must share the last axis")
  nk = _cdiv(c, block)
  for name, s, rows in (("sa", sa, p), ("sb", sb, q)):
    if tuple(s.shape) != (rows, nk):
      raise ValueError(
        f"scaled_matmul_nt: {name} must have shape {(rows, nk)} (rows x "
        f"ceil({c}/{block})), got {tuple(s.shape)}"
      )
  if p == 0 or q == 0 or c == 0:
    return jnp.zeros((p, q), out_dtype)
  t = tiles or default_tiles(p, q)
  pp, qp, cp = _cdiv(p, t.bm) * t.bm, _cdiv(q, t.bn) * t.bn, nk * block
  # Zeros in the padding: padded contraction entries add nothing, padded rows are cut off.
  a = jnp.pad(a, ((0, pp - p), (0, cp - c)))
  b = jnp.pad(b, ((0, qp - q), (0, cp - c)))
  sa_t = jnp.pad(sa.astype(jnp.float32).T, ((0, 0), (0, pp - p)))
  sb_t = jnp.pad(sb.astype(jnp.float32).T, ((0, 0), (0, qp - q)))
  if max(pp, qp) * cp >= 2**31:
    raise ValueError(
      f"scaled_matmul_nt: operands of {max(pp, qp)} x {cp} entries exceed the "
      "kernel's 32-bit offsets; split the GEMM"
    )
  n_p, n_q = pp // t.bm, qp // t.bn
  group = max(1, min(t.group_m, n_p))
  upcast = None if a.dtype == b.dtype else jnp.bfloat16
  row = lambda i: _grouped_ij(i, n_p, n_q, group)[0]
  col = lambda i: _grouped_ij(i, n_p, n_q, group)[1]
  out = pl.pallas_call(
    functools.partial(_kernel, nk=nk, bk=block, upcast=upcast, fast=t.fast_accum),
    out_shape=jax.ShapeDtypeStruct((pp, qp), out_dtype),
    grid=(n_p * n_q,),
    in_specs=[
      pl.BlockSpec((t.bm, cp), lambda i: (row(i), 0)),
      pl.BlockSpec((nk, t.bm), lambda i: (0, row(i))),
      pl.BlockSpec((t.bn, cp), lambda i: (col(i), 0)),
      pl.BlockSpec((nk, t.bn), lambda i: (0, col(i))),
    ],
    out_specs=pl.BlockSpec((t.bm, t.bn), lambda i: (row(i), col(i))),
    compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
    interpret=interpret,
    name="fp8_blockwise_gemm",
  )(a, sa_t, b, sb_t)
  return out[:p, :q]


# --- Decode sizes: x [M, K] from its 1 x 128 groups against a rollout's K-major weight -------

DECODE_MAX_ROWS = 256
# Programs a decode GEMM should run to keep an H100 / H200's 132 multiprocessors busy.
DECODE_PROGRAMS = 128


def decode_bn(n: int) -> int:
  """Columns a program of `decode_matmul_nt` computes for an N-wide output: 32 where that
  still gives DECODE_PROGRAMS programs, else 16 (a 2048-wide q / k / v projection: 128
  programs of 16 columns; a 17920-wide gate / up: 560 of 32)."""
  return 32 if n % 32 == 0 and n // 32 >= DECODE_PROGRAMS else 16


def decode_supported(m: int, n: int, k: int) -> bool:
  """Whether `decode_matmul_nt` takes x [M, K] @ w [K, N]: M a power of two from 16 to
  DECODE_MAX_ROWS (the dot's row tile is all of M), K a multiple of 128, N of 16."""
  return 16 <= m <= DECODE_MAX_ROWS and m & (m - 1) == 0 and k % 128 == 0 and n % 16 == 0


def _decode_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, nk: int, fast: bool):
  """All M rows x bn columns: loop over the contraction blocks, scale each partial (the row's
  group scale times the column block's weight scale), add."""
  m, bn = o_ref.shape

  def body(kb, acc):
    start = pl.multiple_of(kb * 128, 128)
    part = _block_dot(a_ref[:, pl.ds(start, 128)], b_ref[:, pl.ds(start, 128)], fast, 128)
    scale = sa_ref[kb, :][:, None] * sb_ref[0, kb]
    return acc + scale * part

  acc = lax.fori_loop(0, nk, body, jnp.zeros((m, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def decode_matmul_nt(
  a: jax.Array,
  sa_t: jax.Array,
  b: jax.Array,
  sb: jax.Array,
  *,
  bn: Optional[int] = None,
  out_dtype=jnp.bfloat16,
  interpret: bool = False,
  num_warps: int = 4,
  num_stages: int = 4,
) -> jax.Array:
  """out [M, N] = sum_kb sa_t[kb] sb[n // 128, kb] * (a[:, kb] @ b[:, kb]^T) for a decode
  step's few rows: a [M, K] FP8 (a `QuantizedInput`'s values), sa_t [K/128, M] its group
  scales as `QuantizedInput` holds them, b [N, K] FP8 (a rollout's K-major weight), sb its
  128 x 128 block scales [ceil(N/128), >= K/128] as stored (cuBLASLt's padding columns are
  not read). The arithmetic of `scaled_matmul_nt` (K-block dots of FP8 values, each scaled
  by the product of its two scales and added in float32, block after block), with the scales
  read where they lie and a program per bn columns (`decode_bn(N)` by default): N / bn
  programs (128 for a 2048-wide projection at bn = 16), where cuBLASLt's 128 x 128 tiles give
  a 64-row GEMM N / 128 (docs/benchmarks.md, "The decode step measured").
  `decode_supported` says which shapes it takes."""
  (m, k), n = a.shape, b.shape[0]
  nk = k // 128
  bn = bn or decode_bn(n)
  if not decode_supported(m, n, k) or n % bn or 128 % bn or bn < 16 or b.shape[1] != k:
    raise ValueError(
      f"decode_matmul_nt: a [M, K] with M a power of two in [16, {DECODE_MAX_ROWS}], K a "
      f"multiple of 128, b [N, K] with N a multiple of bn = {bn} (16, 32, 64 or 128); got a "
      f"{a.shape}, b {b.shape}"
    )
  if sa_t.shape != (nk, m) or sb.shape[0] != -(-n // 128) or sb.shape[1] < nk:
    raise ValueError(
      f"decode_matmul_nt: scales [K/128, M] = {(nk, m)} and [ceil(N/128), >= K/128] = "
      f"({-(-n // 128)}, >= {nk}) needed, got {sa_t.shape} and {sb.shape}"
    )
  per_block = 128 // bn
  return pl.pallas_call(
    functools.partial(_decode_kernel, nk=nk, fast=True),
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(n // bn,),
    in_specs=[
      pl.BlockSpec((m, k), lambda j: (0, 0)),
      pl.BlockSpec((nk, m), lambda j: (0, 0)),
      pl.BlockSpec((bn, k), lambda j: (j, 0)),
      pl.BlockSpec((1, sb.shape[1]), lambda j: (j // per_block, 0)),
    ],
    out_specs=pl.BlockSpec((m, bn), lambda j: (0, j)),
    compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    interpret=interpret,
    name="fp8_decode_gemm",
  )(a, sa_t.astype(jnp.float32), b, sb.astype(jnp.float32))


# --- The three GEMMs of `linear` ------------------------------------------------------------


def _quant(x: jax.Array, g, group: tuple[int, int], fmt: str):
  """FP8 (q, scale) of a 2-D operand: `group` tiles for block scaling, one scale for tensor.

  The tiles must be those of `linear`'s XLA path (linear._blocks) so both see the same bits.
  """
  tile = tuple(x.shape) if g.scaling == "tensor" else group
  return quantize(x, tile, format_dtype(fmt), g.pow2_scale)


def _weight_scales_per_row(ws: jax.Array, block: int, rows: int, nk: int) -> jax.Array:
  """[nR, nk] per-(row block, K block) weight scales -> [rows, nk] per row."""
  if ws.shape == (1, 1):
    return jnp.broadcast_to(ws, (rows, nk))
  return jnp.repeat(ws, block, axis=0, total_repeat_length=ws.shape[0] * block)[:rows]


def fprop(
  x: jax.Array, wq_t: jax.Array, ws_t: jax.Array, g, out_dtype, *, interpret: bool = False
) -> jax.Array:
  """y [M, N] = x [M, K] @ w from the K-major quantized weight (wq_t [N, K], ws_t its block
  scales [ceil(N/B), ceil(K/B)], or [1, 1] for one tensor scale)."""
  (m, k), n, blk = x.shape, wq_t.shape[0], g.block
  xq, xs = _quant(x, g, (1, blk), g.fmt)
  nk = _cdiv(k, blk)
  sb = _weight_scales_per_row(ws_t, blk, n, nk)
  return scaled_matmul_nt(
    xq, jnp.broadcast_to(xs, (m, nk)), wq_t, sb, block=blk, out_dtype=out_dtype, interpret=interpret
  )


def dgrad(
  dy: jax.Array, wq_t: jax.Array, ws_t: jax.Array, g, out_dtype, *, interpret: bool = False
) -> jax.Array:
  """dx [M, K] = dy [M, N] @ w^T with the forward's weight blocks (K-major: wq_t [N, K])."""
  (m, n), k, blk = dy.shape, wq_t.shape[1], g.block
  dq, ds = _quant(dy, g, (1, blk), g.grad_fmt)
  nn = _cdiv(n, blk)
  sb = _weight_scales_per_row(ws_t.T, blk, k, nn)
  return scaled_matmul_nt(
    dq,
    jnp.broadcast_to(ds, (m, nn)),
    wq_t.T,
    sb,
    block=blk,
    out_dtype=out_dtype,
    interpret=interpret,
  )


def wgrad(x: jax.Array, dy: jax.Array, g, out_dtype, *, interpret: bool = False) -> jax.Array:
  """dw [K, N] = x^T @ dy, contracting over tokens; x and dy in Bx1 groups (B tokens)."""
  (m, k), n, blk = x.shape, dy.shape[1], g.block
  xq, xs = _quant(x, g, (blk, 1), g.fmt)
  dq, ds = _quant(dy, g, (blk, 1), g.grad_fmt)
  nm = _cdiv(m, blk)
  return scaled_matmul_nt(
    xq.T,
    jnp.broadcast_to(xs.T, (k, nm)),
    dq.T,
    jnp.broadcast_to(ds.T, (n, nm)),
    block=blk,
    out_dtype=out_dtype,
    interpret=interpret,
  )
