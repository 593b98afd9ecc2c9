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

It runs where the kernels serve every GEMM (`applies`): compiled for a GPU, 1 x 128 block
scaling in fprop, dgrad and wgrad with the one-pass quantization on (JETRL_FUSED_QUANT), the
GEMMs on cuBLASLt, whole 128-tiles (tokens, model and MLP widths), more rows than a decode
step's. JETRL_FUSED_MLP=0 keeps the unfused path (read once; `set_fused_mlp` overrides it).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax

from jetrl.precision import gemms as _gemms
from jetrl.precision import swiglu_kernel as _sk
from jetrl.precision import target as _target
from jetrl.precision.formats import dtype_from_name, format_dtype
from jetrl.precision.recipes import Precision
from jetrl.precision.weights import quantize_2d

B = _sk.B


@functools.lru_cache(maxsize=None)
def _setting() -> str:
  return os.environ.get("JETRL_FUSED_MLP", "").strip()


def fused_mlp_enabled() -> bool:
  """JETRL_FUSED_MLP=0 or 1 (unset: on, where `applies` holds)."""
  setting = _setting()
  if setting not in ("", "0", "1"):
    raise ValueError(f"JETRL_FUSED_MLP must be 0, 1 or unset (the default), got {setting!r}")
  return setting != "0"


def set_fused_mlp(value: Optional[bool]) -> None:
  """Use (True) or not (False) the fused MLP in programs traced from now on; None: default."""
  _setting.cache_clear()
  if value is None:
    os.environ.pop("JETRL_FUSED_MLP", None)
  else:
    os.environ["JETRL_FUSED_MLP"] = "1" if value else "0"


def _plain(w) -> bool:
  return isinstance(w, jax.Array) and w.ndim == 2  # not a LoRA or pre-quantized weight


def applies(m: int, wg, wu, wd, precision: Optional[Precision]) -> bool:
  """Whether the MLP of m token rows runs here (the module doc's conditions)."""
  if _target.platform() != "gpu" or not isinstance(precision, Precision):
    return False
  fp, dg, wgr = precision.fprop, precision.dgrad, precision.wgrad
  if precision.batch_invariant or fp is None or dg is None or wgr is None:
    return False
  if not (_plain(wg) and _plain(wu) and _plain(wd)) or not fused_mlp_enabled():
    return False
  d, f = wg.shape
  if wu.shape != (d, f) or wd.shape != (f, d):
    return False
  if m <= _gemms.ONE_PASS_MAX_ROWS or m % B or d % B or f % B:
    return False
  if (dg.scaling, dg.block, dg.fmt, dg.pow2_scale) != (fp.scaling, fp.block, fp.fmt, fp.pow2_scale):
    return False  # dgrad reads fprop's weight blocks
  cd = dtype_from_name(precision.compute_dtype)
  ok = _gemms.runs_groups_gemm
  return (
    ok(fp, m, f, d, fp.fmt, fp.fmt, cd, True)
    and ok(fp, m, d, f, fp.fmt, fp.fmt, cd, True)
    and ok(dg, m, f, d, dg.grad_fmt, dg.fmt, cd, True)
    and ok(dg, m, d, f, dg.grad_fmt, dg.fmt, cd, True)
    and ok(wgr, f, d, m, wgr.fmt, wgr.grad_fmt, wd.dtype, False)
    and ok(wgr, d, f, m, wgr.fmt, wgr.grad_fmt, wg.dtype, False)
  )


def swiglu_mlp(x: jax.Array, wg, wu, wd, precision: Precision) -> jax.Array:
  """down(silu(x @ wg) * (x @ wu)) in the precision's compute dtype, x [..., D]; where
  `applies` holds for x's rows (the caller checks)."""
  cd = dtype_from_name(precision.compute_dtype)
  lead, d = x.shape[:-1], x.shape[-1]
  y = _mlp(x.reshape(-1, d).astype(cd), wg, wu, wd, precision)
  return y.reshape(*lead, d)


def _interpret() -> bool:
  return _target.interpreting()


def _fprop(aq, as_t, wq, cd):
  q_t, s_t = wq.nk() if _interpret() else wq.nk_padded()
  return _gemms.gemm_groups(aq, as_t, q_t, s_t, b_blocks=True, out_dtype=cd).astype(cd)


def _dgrad(aq, as_t, wq, cd):
  q, s = wq.kn()  # [K, N]: contiguous along N, the contraction axis of dgrad
  return _gemms.gemm_groups(aq, as_t, q, s, b_blocks=True, out_dtype=cd).astype(cd)


def _wgrad(a_cols, b_cols, out_dtype):
  return _gemms.gemm_groups(*a_cols, *b_cols, b_blocks=False, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mlp(x2, wg, wu, wd, precision):
  return _mlp_fwd(x2, wg, wu, wd, precision)[0]


def _mlp_fwd(x2, wg, wu, wd, precision: Precision):
  cd = dtype_from_name(precision.compute_dtype)
  fp = precision.fprop
  wgq, wuq, wdq = (quantize_2d(w, fp, True) for w in (wg, wu, wd))
  xq, xs_t = _gemms._rows_cols(x2, fp.fmt, rows=True)
  gate, up = _fprop(xq, xs_t, wgq, cd), _fprop(xq, xs_t, wuq, cd)
  hq, hs_t = _sk.swiglu_rows(gate, up, cd, format_dtype(fp.fmt), interpret=_interpret())
  y = _fprop(hq, hs_t, wdq, cd)
  return y, (x2, gate, up, wg, wu, wd, wgq, wuq, wdq)


def _mlp_bwd(precision: Precision, res, dy):
  x2, gate, up, wg, wu, wd, wgq, wuq, wdq = res
  cd = dtype_from_name(precision.compute_dtype)
  dg, wgr = precision.dgrad, precision.wgrad
  dy2 = dy.astype(cd)
  dh = _gemms.dgrad(dy2, wdq, dg, cd).astype(cd)
  h_c, dg_r, dg_c, du_r, du_c = _sk.swiglu_backward(
    gate,
    up,
    dh,
    cd,
    format_dtype(wgr.fmt),
    format_dtype(dg.grad_fmt),
    format_dtype(wgr.grad_fmt),
    interpret=_interpret(),
  )
  dy_c = _gemms._rows_cols(dy2, wgr.grad_fmt, rows=False)
  x_c = _gemms._rows_cols(x2, wgr.fmt, rows=False)
  # The two dx's summed in cd, as JAX sums the cotangents of a value two functions read.
  dx = _dgrad(*dg_r, wgq, cd) + _dgrad(*du_r, wuq, cd)
  dwg = _wgrad(x_c, dg_c, wg.dtype).astype(wg.dtype)
  dwu = _wgrad(x_c, du_c, wu.dtype).astype(wu.dtype)
  dwd = _wgrad(h_c, dy_c, wd.dtype).astype(wd.dtype)
  return dx, dwg, dwu, dwd


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
