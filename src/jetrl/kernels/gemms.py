"""The three FP8 GEMMs of `linear` (fprop, dgrad, wgrad), each on the backend its Fp8Gemm picks.

  fprop  y  = x @ w     x in 1xB groups along K, w in BxB blocks
  dgrad  dx = dy @ w^T  dy in 1xB groups along N, the *same* BxB weight blocks as fprop
  wgrad  dw = x^T @ dy  x and dy in Bx1 groups (B tokens x 1 channel)

Every backend is handed the same FP8 values and scales (`jetrl.precision.quantize`, traced
into the surrounding program), so backends differ only in the order of float32 sums:
  xla       dequantize, then one float32 matmul (the CPU emulation and the reference);
  cublaslt  cuBLASLt's blockwise-scaled FP8 GEMM (Hopper; jetrl.kernels.cublaslt);
  pallas    the Pallas Triton kernel (jetrl.kernels.gemm_pallas), also in interpret mode.
Per-tensor scaling ("tensor") on the cuBLASLt backend is XLA's native FP8 dot with the two
scales applied to its float32 result. See docs/numerics.md for the formulas and tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import Optional

from jetrl.kernels import backend as _backend
from jetrl.kernels import cublaslt as _cublaslt
from jetrl.kernels import gemm_pallas as _gp
from jetrl.kernels import quant_kernel as _qk
from jetrl.kernels.device import Device, current_device
from jetrl.precision.formats import dot_precision, format_dtype
from jetrl.precision import xla_gemms as _xla
from jetrl.precision.quantize import dequantize, quantize_rows_t
from jetrl.precision.xla_gemms import matmul_f32
from jetrl.precision.weights import QuantizedInput, QuantizedWeight


def _dev(dev: Optional[Device]) -> Device:
  return current_device() if dev is None else dev


def matmul_cd(a: jax.Array, b: jax.Array, cd, dev: Optional[Device] = None):
  """a @ b with float32 accumulation, rounded to the compute dtype cd: `matmul_f32(a,
  b).astype(cd)`. Compiled for a GPU with a 16-bit cd, the dot itself writes cd (cuBLAS
  rounds its float32 accumulator once, the same values): the float32 result and its convert
  would be a second kernel wherever the consumer is not an XLA fusion (a Pallas kernel).
  (Not when a GPU program runs here, `Device.interpret`: a CPU's dot may sum in cd.)"""
  dev = _dev(dev)
  if dev.gpu and not dev.interpret and jnp.dtype(cd).itemsize == 2:
    return jax.lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), precision=dot_precision(a, b), preferred_element_type=cd
    )
  return matmul_f32(a, b).astype(cd)


# Up to this many rows (a decode step's), the cuBLASLt backend quantizes an activation in one
# Pallas kernel (`quant_kernel.quantize_rows_t`) on a GPU: XLA takes three kernels for it, and
# at these sizes a step's time is its kernel count (docs/benchmarks.md, "Compiled programs").
ONE_PASS_MAX_ROWS = 256


def _quant_rows_t(x, g, fmt: str, dev: Device):
  """x's 1xB groups with their scales transposed, as cuBLASLt's `gemm_t` reads them: the
  same FP8 values and scales from XLA's fusions or, at decode sizes on a GPU, one kernel."""
  m, k = x.shape
  if (
    dev.gpu
    and m <= ONE_PASS_MAX_ROWS
    and _qk.row_block(m)
    and k % _qk.B == 0
    and g.block == _qk.B
    and not g.pow2_scale
  ):
    return _qk.quantize_rows_t(x, format_dtype(fmt))
  return quantize_rows_t(x, g.block, format_dtype(fmt), g.pow2_scale)


def fused_quant_enabled(dev: Optional[Device] = None) -> bool:
  """Whether the cuBLASLt backend quantizes activations and gradients with the one-pass
  Pallas kernel (jetrl.kernels.quant_kernel) instead of XLA's fusions: `KernelConfig.fused_quant`
  says; unset, it is on in programs compiled for a GPU. The same FP8 values and scales
  either way (bit-identical in interpret mode on the CPU, and in the GPU suite's compiled
  test, tests/precision/test_quant_kernel.py)."""
  return _dev(dev).fused_quant


def decode_gemm(dev: Optional[Device] = None) -> str:
  """Which kernel runs a decode step's FP8 GEMMs from a `QuantizedInput` on a GPU
  (cuBLASLt's blockwise GEMM, or `gemm_pallas.decode_matmul_nt`: a program per 16 or 32
  columns where cuBLASLt runs 128 x 128 tiles, for rows a power of two from 16 to 256):
  `KernelConfig.decode_gemm` says ("cublaslt" unless set). The same FP8 values and scales
  either way; the sums in another order (docs/numerics.md)."""
  return _dev(dev).kernels.decode_gemm


def _one_by_128(g) -> bool:
  """1 x 128 / 128 x 128 block scaling with plain scales: what the Pallas quantization kernels,
  the cuBLASLt block GEMM and a `QuantizedInput` serve."""
  return g.scaling == "block" and g.block == _qk.B and not g.pow2_scale


def _fused(g, dev: Device) -> bool:
  return _one_by_128(g) and dev.fused_quant


def rows_cols(x, fmt: str, rows: bool, dev: Optional[Device] = None):
  """The one-pass kernel's rows or cols pair."""
  ((q, s_t),) = _qk.quantize_rows_cols(
    x, format_dtype(fmt), rows=rows, cols=not rows, interpret=_dev(dev).interpret_kernels
  )
  return q, s_t


def rows_and_cols(x, row_fmt: str, col_fmt: str, dev: Optional[Device] = None):
  """(x's 1 x 128 groups, x's 128 x 1 groups) as the one-pass kernel writes them (`rows_cols`),
  in one pass over x where both are one format (`quant_kernel.quantize_both`)."""
  return _qk.quantize_both(
    x, format_dtype(row_fmt), format_dtype(col_fmt), interpret=_dev(dev).interpret_kernels
  )


def _choose(g, p: int, q: int, c: int, a_fmt: str, b_fmt: str, out_dtype, b_blocks, dev) -> str:
  """The backend for one GEMM out[p, q] (contraction c), after per-shape fallbacks."""
  name = _backend.resolve(g, dev)
  if name == "cublaslt" and g.scaling == "block":
    if not _cublaslt.supported(
      p, q, c, format_dtype(a_fmt), format_dtype(b_fmt), out_dtype, b_blocks
    ):
      name = _backend.fallback(name, g, dev)
  return name


def _tensor_dot(aq, sa, bq, sb, contract, out_dtype):
  """XLA's native FP8 dot (cuBLASLt on GPUs), one scale per operand applied to its result."""
  y = jax.lax.dot_general(aq, bq, (contract, ((), ())), preferred_element_type=jnp.float32)
  return (y * (sa.reshape(()) * sb.reshape(()))).astype(out_dtype)


def fprop(x2: jax.Array, w: QuantizedWeight, g, out_dtype, dev: Optional[Device] = None):
  """y [M, N] = x2 [M, K] @ w (already quantized); float32 on XLA, out_dtype on kernels."""
  dev = _dev(dev)
  (m, k), n = x2.shape, w.shape[1]
  name = _choose(g, m, n, k, g.fmt, g.fmt, out_dtype, True, dev)
  if name == "xla":
    return _xla.fprop(x2, w, g)
  q_t, s_t = w.nk()
  if name == "cublaslt" and g.scaling == "tensor":
    xq, xs = _xla.quant(x2, g, "row", g.fmt)
    return _tensor_dot(xq, xs, q_t, s_t, ((1,), (1,)), out_dtype)
  if name == "cublaslt":
    q_t, s_t = w.nk_padded()
    if _fused(g, dev) and m > ONE_PASS_MAX_ROWS:  # fewer rows: `_quant_rows_t`'s, unpadded
      xq, xs_t = rows_cols(x2, g.fmt, True, dev)
      return _cublaslt.gemm_t(xq, xs_t, q_t, s_t, b_blocks=True, out_dtype=out_dtype)
    xq, xs_t = _quant_rows_t(x2, g, g.fmt, dev)
    return _cublaslt.gemm_t(xq, xs_t, q_t, s_t, b_blocks=True, out_dtype=out_dtype)
  return _gp.fprop(x2, q_t, s_t, g, out_dtype, interpret=name == "pallas_interpret")


def with_gemm_scales(w: QuantizedWeight, g, dev: Optional[Device] = None) -> QuantizedWeight:
  """w with its block scales padded once, as cuBLASLt reads them (`QuantizedWeight.scale_pad`),
  when its GEMMs run there: otherwise each GEMM pads them again (a kernel per GEMM whose
  ceil(K/128) is not a multiple of 4, inside a decode step). Other backends: w unchanged."""
  if not (w.k_major and not w.scale_pad and _one_by_128(g)):
    return w
  if _backend.resolve(g, dev) != "cublaslt":
    return w
  pad = _cublaslt.scale_padding(w.shape[-2])
  if not pad:
    return w
  widths = [(0, 0)] * (w.scale.ndim - 1) + [(0, pad)]
  scale = jnp.pad(w.scale, widths, constant_values=1.0)
  return QuantizedWeight(w.q, scale, k_major=True, scale_pad=pad)


def takes_quantized_input(g, m: int, n: int, k: int, out_dtype, dev: Optional[Device] = None):
  """Whether `fprop_quantized` runs this GEMM (x [M, K] @ w [K, N]) from a `QuantizedInput`
  on the GPU kernel: the cuBLASLt backend with 1 x 128 groups and plain (not power-of-two)
  scales, the only case in which a decode step's fused kernels quantize for it (and XLA's
  FP8 GEMM when a GPU program is traced to run on this machine, `Device.interpret`)."""
  dev = _dev(dev)
  if g is None or not _one_by_128(g):
    return False
  # A GPU program traced to run here (`Device.interpret`) takes the same path on XLA.
  want = "xla" if dev.interpret else "cublaslt"
  return _choose(g, m, n, k, g.fmt, g.fmt, out_dtype, True, dev) == want


def fprop_quantized(x: QuantizedInput, w: QuantizedWeight, g, out_dtype, dev=None) -> jax.Array:
  """`fprop` of an activation already quantized as fprop quantizes it (`QuantizedInput`):
  the same GEMM on the same FP8 values and scales, without quantizing x."""
  (m, k), n = x.shape, w.shape[1]
  if x.q.dtype != format_dtype(g.fmt) or x.scale_t.shape != (-(-k // _qk.B), m):
    raise ValueError(
      f"linear: a QuantizedInput of {g.fmt} values [M, K] with scales [ceil(K/128), M] is "
      f"needed, got {x.q.dtype} {x.shape} with scales {x.scale_t.shape}"
    )
  dev = _dev(dev)
  name = _choose(g, m, n, k, g.fmt, g.fmt, out_dtype, True, dev)
  if name == "cublaslt" and _one_by_128(g):
    q_t, s_t = w.nk_padded()
    if dev.kernels.decode_gemm == "pallas" and w.k_major and _gp.decode_supported(m, n, k):
      return _gp.decode_matmul_nt(x.q, x.scale_t, q_t, s_t, out_dtype=out_dtype)
    return _cublaslt.gemm_t(x.q, x.scale_t, q_t, s_t, b_blocks=True, out_dtype=out_dtype)
  if name == "xla" and g.scaling == "block" and g.block == _qk.B:
    return _xla.fprop_quantized(x, w)
  raise ValueError(
    f"linear: a QuantizedInput needs 1x128 block scaling on the cublaslt or xla GEMM "
    f"backend, got {g.scaling} scaling, block {g.block}, backend {name}"
  )


def dgrad(dy2: jax.Array, w: QuantizedWeight, g, out_dtype, dev: Optional[Device] = None):
  """dx [M, K] = dy2 [M, N] @ w^T with the forward's weight blocks."""
  dev = _dev(dev)
  (m, n), k = dy2.shape, w.shape[0]
  name = _choose(g, m, k, n, g.grad_fmt, g.fmt, out_dtype, True, dev)
  if name == "xla":
    return _xla.dgrad(dy2, w, g)
  if name == "cublaslt" and g.scaling == "tensor":
    q, s = w.kn()
    dq, ds = _xla.quant(dy2, g, "row", g.grad_fmt)
    return _tensor_dot(dq, ds, q, s, ((1,), (1,)), out_dtype)
  if name == "cublaslt":
    q, s = w.kn()  # [K, N]: contiguous along N, the contraction axis of dgrad
    if _fused(g, dev) and m > ONE_PASS_MAX_ROWS:
      dq, ds_t = rows_cols(dy2, g.grad_fmt, True, dev)
      return _cublaslt.gemm_t(dq, ds_t, q, s, b_blocks=True, out_dtype=out_dtype)
    dq, ds_t = _quant_rows_t(dy2, g, g.grad_fmt, dev)
    return _cublaslt.gemm_t(dq, ds_t, q, s, b_blocks=True, out_dtype=out_dtype)
  q_t, s_t = w.nk()
  return _gp.dgrad(dy2, q_t, s_t, g, out_dtype, interpret=name == "pallas_interpret")


def wgrad(x2: jax.Array, dy2: jax.Array, g, out_dtype, dev: Optional[Device] = None):
  """dw [K, N] = x2^T @ dy2, contracting over tokens (Bx1 groups)."""
  dev = _dev(dev)
  (m, k), n = x2.shape, dy2.shape[1]
  name = _choose(g, k, n, m, g.fmt, g.grad_fmt, out_dtype, False, dev)
  if name == "xla":
    return _xla.wgrad(x2, dy2, g)
  if name == "cublaslt" and g.scaling == "tensor":
    xq, xs = _xla.quant(x2, g, "col", g.fmt)
    dq, ds = _xla.quant(dy2, g, "col", g.grad_fmt)
    return _tensor_dot(xq, xs, dq, ds, ((0,), (0,)), out_dtype)
  if name == "cublaslt":
    # x^T and dy^T in 1xB groups along tokens: the transposes of their Bx1 quantization.
    if _fused(g, dev):
      xq, xs_t = rows_cols(x2, g.fmt, False, dev)
      dq, ds_t = rows_cols(dy2, g.grad_fmt, False, dev)
      return _cublaslt.gemm_t(xq, xs_t, dq, ds_t, b_blocks=False, out_dtype=out_dtype)
    xq, xs_t = _quant_rows_t(x2.T, g, g.fmt, dev)
    dq, ds_t = _quant_rows_t(dy2.T, g, g.grad_fmt, dev)
    return _cublaslt.gemm_t(xq, xs_t, dq, ds_t, b_blocks=False, out_dtype=out_dtype)
  return _gp.wgrad(x2, dy2, g, out_dtype, interpret=name == "pallas_interpret")


def _dequant_t(q: jax.Array, s_t: jax.Array) -> jax.Array:
  """float32 values of q [P, C] from 1 x 128 scales transposed, s_t [C/128, P]."""
  return dequantize(q, s_t.T, (1, _qk.B))


def gemm_groups(a, a_scale_t, b, b_scale, *, b_blocks: bool, out_dtype, dev=None) -> jax.Array:
  """out [P, Q] = a [P, C] . b [Q, C] from operands already quantized as the cuBLASLt kernel
  reads them (`cublaslt.gemm_t`): a in 1 x 128 groups along C, scales transposed
  [C/128, P]; b in 128 x 128 blocks (scales [Q/128, C/128]) or 1 x 128 groups (scales
  transposed, [C/128, Q]). On a GPU the cuBLASLt kernel; a GPU program run here
  (`Device.interpret`) dequantizes and multiplies in float32 (the XLA backend's product
  of the same FP8 values)."""
  dev = _dev(dev)
  if dev.gpu and not dev.interpret:
    return _cublaslt.gemm_t(a, a_scale_t, b, b_scale, b_blocks=b_blocks, out_dtype=out_dtype)
  if b_blocks:
    bd = dequantize(b, b_scale[:, : -(-b.shape[1] // _qk.B)], (_qk.B, _qk.B))
  else:
    bd = _dequant_t(b, b_scale)
  return matmul_f32(_dequant_t(a, a_scale_t), bd, transpose_b=True)


def runs_groups_gemm(
  g, p: int, q: int, c: int, a_fmt: str, b_fmt: str, out_dtype, b_blocks, dev=None
) -> bool:
  """Whether `gemm_groups` serves this GEMM as `fprop` / `dgrad` / `wgrad` would run it: 1 x 128
  block scaling with the one-pass quantization on, on cuBLASLt (on XLA in a GPU program run
  here, `Device.interpret`)."""
  dev = _dev(dev)
  if g is None or not _fused(g, dev):
    return False
  want = "xla" if dev.interpret else "cublaslt"
  return _choose(g, p, q, c, a_fmt, b_fmt, out_dtype, b_blocks, dev) == want


def fprop_groups(xq, xs_t, w: QuantizedWeight, cd, dev: Optional[Device] = None) -> jax.Array:
  """y = x @ w in cd from x's 1 x 128 groups (`gemm_groups`), w quantized K-major."""
  dev = _dev(dev)
  q_t, s_t = w.nk() if dev.interpret else w.nk_padded()
  return gemm_groups(xq, xs_t, q_t, s_t, b_blocks=True, out_dtype=cd, dev=dev).astype(cd)


def dgrad_groups(dq, ds_t, w: QuantizedWeight, cd, dev: Optional[Device] = None) -> jax.Array:
  """dx = dy @ w^T in cd from dy's 1 x 128 groups, with the forward's weight blocks."""
  q, s = w.kn()  # [K, N]: contiguous along N, the contraction axis of dgrad
  return gemm_groups(dq, ds_t, q, s, b_blocks=True, out_dtype=cd, dev=dev).astype(cd)


def wgrad_groups(x_cols, dy_cols, out_dtype, dev: Optional[Device] = None) -> jax.Array:
  """dw = x^T @ dy from both operands' 128 x 1 groups, transposed ((q_t, s) pairs)."""
  out = gemm_groups(*x_cols, *dy_cols, b_blocks=False, out_dtype=out_dtype, dev=dev)
  return out.astype(out_dtype)
