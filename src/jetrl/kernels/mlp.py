"""The SwiGLU MLP, down(silu(gate(x)) * up(x)), as one differentiable function whose FP8
groups are written by the operators that produce them.

Through `linear` each projection quantizes its own operands: x once for gate's fprop and again
for up's, h = silu(gate) * up after XLA's fusion has written it in bf16, and in the backward
dgate and dup (1 x 128 for dgrad, 128 x 1 for wgrad) and h (128 x 1) after the fusion of
SwiGLU's backward has written them: five one-pass kernels of the MLP's widest arrays, each
reading what the fusion before it just wrote. Here (a custom VJP over the whole MLP):

  forward   x's 1 x 128 groups once, for gate and up;
            `swiglu_kernel.swiglu_rows`: h's groups for down, from gate and up;
  backward  `swiglu_kernel.swiglu_backward`: from gate, up and dh, h's 128 x 1 groups and
            dgate's and dup's groups in both layouts, in one kernel;
            x's 128 x 1 groups once, for gate's and up's wgrad.

The GEMMs are `linear`'s (docs/numerics.md): the same FP8 weight blocks for fprop and dgrad,
the same groups for every operand. Every FP8 group is `quantize`'s of the bf16 value it stands
for. The values themselves are the unfused path's, except dgate, whose elementwise backward is
computed in float32 and rounded once (swiglu_kernel's doc); so the MLP's outputs and gradients
equal the unfused path's up to FP8 roundings that a bf16 ulp of dgate moves
(tests/precision/test_mlp.py, against it and against float64).

With norm=(weight, eps), `swiglu_mlp` also takes the RMSNorm before gate and up: its kernel
(`norm_kernel.norm_rows_cols`) writes x's groups in both layouts in one pass, and its backward
is JAX's autodiff of the same formula (`rms_norm_cd`). `norm_linear` does the same for one
projection (the fused q / k / v).

It runs where the kernels serve every GEMM (`applies`, `norm_applies`): compiled for a GPU,
1 x 128 block scaling in fprop, dgrad and wgrad with the one-pass quantization on
(`KernelConfig.fused_quant`), the GEMMs on cuBLASLt, whole 128-tiles (tokens, model and MLP
widths), more rows than a decode step's. `KernelConfig.fused_mlp=False` keeps the unfused path,
the norms' too.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

from jetrl.kernels import gemms as _gemms
from jetrl.kernels.device import Device
from jetrl.kernels import norm_kernel as _nk
from jetrl.kernels import swiglu_kernel as _sk
from jetrl.precision.formats import dtype_from_name, format_dtype
from jetrl.precision.recipes import Precision
from jetrl.precision.weights import quantize_2d

B = _sk.B


def _plain(w) -> bool:
  return isinstance(w, jax.Array) and w.ndim == 2  # not a LoRA or pre-quantized weight


def _gemms_run(precision: Precision, m: int, k: int, n: int, w_dtype, dev: Device) -> bool:
  """Whether fprop, dgrad and wgrad of x [m, k] @ w [k, n] all run on the groups' GEMM."""
  fp, dg, wgr = precision.fprop, precision.dgrad, precision.wgrad
  cd = dtype_from_name(precision.compute_dtype)
  ok = _gemms.runs_groups_gemm
  return (
    ok(fp, m, n, k, fp.fmt, fp.fmt, cd, True, dev)
    and ok(dg, m, k, n, dg.grad_fmt, dg.fmt, cd, True, dev)
    and ok(wgr, k, n, m, wgr.fmt, wgr.grad_fmt, w_dtype, False, dev)
  )


def _precision_applies(precision, dev: Device) -> bool:
  if not dev.gpu or not isinstance(precision, Precision):
    return False
  fp, dg, wgr = precision.fprop, precision.dgrad, precision.wgrad
  if precision.batch_invariant or fp is None or dg is None or wgr is None:
    return False
  # dgrad reads fprop's weight blocks
  return dev.kernels.fused_mlp and (dg.scaling, dg.block, dg.fmt, dg.pow2_scale) == (
    fp.scaling,
    fp.block,
    fp.fmt,
    fp.pow2_scale,
  )


def applies(m: int, wg, wu, wd, precision: Optional[Precision], dev: Device) -> bool:
  """Whether the MLP of m token rows runs here (the module doc's conditions)."""
  if not _precision_applies(precision, dev) or not (_plain(wg) and _plain(wu) and _plain(wd)):
    return False
  d, f = wg.shape
  if wu.shape != (d, f) or wd.shape != (f, d):
    return False
  if m <= _gemms.ONE_PASS_MAX_ROWS or m % B or d % B or f % B:
    return False
  return _gemms_run(precision, m, d, f, wg.dtype, dev) and _gemms_run(
    precision, m, f, d, wd.dtype, dev
  )


def norm_applies(m: int, norm_weight, w, precision: Optional[Precision], dev: Device) -> bool:
  """Whether RMSNorm before a projection w [D, N] (`norm_linear`, or the MLP's norm) of m
  token rows writes its FP8 groups itself: the MLP's conditions for that GEMM."""
  if not _precision_applies(precision, dev) or not (
    _plain(w) and isinstance(norm_weight, jax.Array)
  ):
    return False
  d, n = w.shape
  if norm_weight.shape != (d,) or m <= _gemms.ONE_PASS_MAX_ROWS or m % B or d % B or n % B:
    return False
  return _gemms_run(precision, m, d, n, w.dtype, dev)


def swiglu_mlp(x: jax.Array, wg, wu, wd, precision: Precision, dev: Device, norm=None):
  """down(silu(h @ wg) * (h @ wu)) in the precision's compute dtype, x [..., D], where h is x,
  or with norm = (weight, eps) the RMSNorm of x, whose kernel writes h's FP8 groups
  (`norm_kernel`); where `applies` (and `norm_applies`) hold (the caller checks)."""
  cd = dtype_from_name(precision.compute_dtype)
  lead, d = x.shape[:-1], x.shape[-1]
  nw, eps = norm if norm is not None else (None, 0.0)
  y = _mlp(x.reshape(-1, d).astype(cd), nw, wg, wu, wd, precision, float(eps), dev)
  return y.reshape(*lead, d)


def norm_linear(x: jax.Array, norm_weight, eps: float, w, precision: Precision, dev: Device):
  """rms_norm(x) @ w in the precision's compute dtype, x [..., D]: the norm's kernel writes
  the GEMM's FP8 groups in both layouts (fprop's and wgrad's), one pass over x; where
  `norm_applies` holds (the caller checks)."""
  cd = dtype_from_name(precision.compute_dtype)
  lead, d = x.shape[:-1], x.shape[-1]
  y = _norm_linear(x.reshape(-1, d).astype(cd), norm_weight, w, precision, float(eps), dev)
  return y.reshape(*lead, w.shape[1])


def _input_groups(x2, nw, eps: float, precision: Precision, dev: Device):
  """x's 1 x 128 groups for fprop, and its 128 x 1 groups for wgrad where the norm's kernel
  writes them with the rows (else None: the backward quantizes x itself)."""
  cd = dtype_from_name(precision.compute_dtype)
  fp, wgr = precision.fprop, precision.wgrad
  if nw is None:
    return _gemms.rows_cols(x2, fp.fmt, True, dev), None
  rows, cols = _nk.norm_rows_cols(
    x2, nw, eps, cd, format_dtype(fp.fmt), format_dtype(wgr.fmt), interpret=dev.interpret
  )
  return rows, cols


def _input_backward(x2, nw, eps: float, precision: Precision, dh):
  """(dx, dnorm_weight) from the gradient of the projections' input h (x itself, or the norm
  of x: the norm's backward by JAX's autodiff of `rms_norm_cd`)."""
  if nw is None:
    return dh, None
  cd = dtype_from_name(precision.compute_dtype)
  _, vjp = jax.vjp(lambda a, b: _nk.rms_norm_cd(a, b, eps, cd), x2, nw)
  return vjp(dh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _mlp(x2, nw, wg, wu, wd, precision, eps, dev):
  return _mlp_fwd(x2, nw, wg, wu, wd, precision, eps, dev)[0]


def _mlp_fwd(x2, nw, wg, wu, wd, precision: Precision, eps, dev: Device):
  cd = dtype_from_name(precision.compute_dtype)
  fp = precision.fprop
  wgq, wuq, wdq = (quantize_2d(w, fp, True) for w in (wg, wu, wd))
  (xq, xs_t), x_c = _input_groups(x2, nw, eps, precision, dev)
  gate = _gemms.fprop_groups(xq, xs_t, wgq, cd, dev)
  up = _gemms.fprop_groups(xq, xs_t, wuq, cd, dev)
  hq, hs_t = _sk.swiglu_rows(gate, up, cd, format_dtype(fp.fmt), interpret=dev.interpret)
  y = _gemms.fprop_groups(hq, hs_t, wdq, cd, dev)
  return y, (x2, nw, x_c, gate, up, wg, wu, wd, wgq, wuq, wdq)


def _mlp_bwd(precision: Precision, eps, dev: Device, res, dy):
  x2, nw, x_c, gate, up, wg, wu, wd, wgq, wuq, wdq = res
  cd = dtype_from_name(precision.compute_dtype)
  dg, wgr = precision.dgrad, precision.wgrad
  dy_r, dy_c = _gemms.rows_and_cols(dy.astype(cd), dg.grad_fmt, wgr.grad_fmt, dev)  # one pass
  dh = _gemms.dgrad_groups(*dy_r, wdq, cd, dev)
  h_c, dg_r, dg_c, du_r, du_c = _sk.swiglu_backward(
    gate,
    up,
    dh,
    cd,
    format_dtype(wgr.fmt),
    format_dtype(dg.grad_fmt),
    format_dtype(wgr.grad_fmt),
    interpret=dev.interpret,
  )
  if x_c is None:
    x_c = _gemms.rows_cols(x2, wgr.fmt, False, dev)
  # The two dx's summed in cd, as JAX sums the cotangents of a value two functions read.
  dxh = _gemms.dgrad_groups(*dg_r, wgq, cd, dev) + _gemms.dgrad_groups(*du_r, wuq, cd, dev)
  dx, dnw = _input_backward(x2, nw, eps, precision, dxh)
  dwg = _gemms.wgrad_groups(x_c, dg_c, wg.dtype, dev)
  dwu = _gemms.wgrad_groups(x_c, du_c, wu.dtype, dev)
  dwd = _gemms.wgrad_groups(h_c, dy_c, wd.dtype, dev)
  return dx, dnw, dwg, dwu, dwd


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm_linear(x2, nw, w, precision, eps, dev):
  return _norm_linear_fwd(x2, nw, w, precision, eps, dev)[0]


def _norm_linear_fwd(x2, nw, w, precision: Precision, eps, dev: Device):
  cd = dtype_from_name(precision.compute_dtype)
  wq = quantize_2d(w, precision.fprop, True)
  (xq, xs_t), x_c = _input_groups(x2, nw, eps, precision, dev)
  return _gemms.fprop_groups(xq, xs_t, wq, cd, dev), (x2, nw, x_c, w, wq)


def _norm_linear_bwd(precision: Precision, eps, dev: Device, res, dy):
  x2, nw, x_c, w, wq = res
  cd = dtype_from_name(precision.compute_dtype)
  dy_r, dy_c = _gemms.rows_and_cols(
    dy.astype(cd), precision.dgrad.grad_fmt, precision.wgrad.grad_fmt, dev
  )  # one pass over dy for both GEMMs
  dh = _gemms.dgrad_groups(*dy_r, wq, cd, dev)
  dx, dnw = _input_backward(x2, nw, eps, precision, dh)
  return dx, dnw, _gemms.wgrad_groups(x_c, dy_c, w.dtype, dev)


_norm_linear.defvjp(_norm_linear_fwd, _norm_linear_bwd)
