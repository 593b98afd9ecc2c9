"""JAX's Pallas flash-attention kernel, forward and backward, each run on its shards of a mesh.

`jax.experimental.pallas.ops.gpu.attention.mha` is a custom VJP over two Pallas calls. On a
device mesh XLA cannot partition a Pallas call, so it gathered q, k and v onto every device and
each device attended over the whole batch (docs/scaling.md, "The GPU kernels on a mesh"). Here
the same two kernels, the forward (with its log-sum-exp residual) and the backward, are each
wrapped with `jetrl.kernels.partition.sharded`: rows and heads pass through sharded, the
sequence and the head dimension stay whole on each device. One device runs the same kernels on
the same operands as `mha` (the forward of `mha`'s own VJP, and its backward), so the values
are the same.

The backward is JAX's `_mha_backward`, a private function; where it is missing or its
signature differs from the one this module was written against, `flash_attention` falls back
to `mha` itself (the kernels gathered on a mesh, as before).
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import jax

from jetrl.kernels import partition

_BWD_PARAMS = (
  "sm_scale",
  "causal",
  "block_sizes",
  "backward_pass_impl",
  "num_warps",
  "num_stages",
  "grid",
  "interpret",
  "debug",
  "return_residuals",
  "res",
  "do",
)
_WHOLE = 1 << 62  # an axis never split: the sequence, the head dimension


def _kernels():
  """(JAX's attention module, its backward function or None where it is not the one known)."""
  from jax.experimental.pallas.ops.gpu import attention as f  # noqa: PLC0415

  bwd = getattr(f, "_mha_backward", None)
  try:
    ok = bwd is not None and tuple(inspect.signature(bwd).parameters) == _BWD_PARAMS
  except (TypeError, ValueError):
    ok = False
  return f, (bwd if ok else None)


def partitioned_backward_available() -> bool:
  return _kernels()[1] is not None


def flash_attention(q, k, v, segment_ids: Optional[jax.Array], sm_scale: float, interpret=False):
  """Causal attention, q, k, v [B, T, H, Dh] (k and v with q's heads), segment_ids [B, T] or
  None: `mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=True)`, partitioned on a mesh."""
  f, bwd = _kernels()
  if bwd is None:
    return f.mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=True, interpret=interpret)
  if segment_ids is None:
    return _attend(q, k, v, float(sm_scale), bool(interpret))
  return _attend_seg(q, k, v, segment_ids, float(sm_scale), bool(interpret))


def flash_backward(q, k, v, segment_ids, out, lse, do, sm_scale: float, interpret=False):
  """(dq, dk, dv) of `flash_attention` from a forward's residuals: q, k, v, out, do
  [B, T, H, Dh], segment_ids [B, T] or None, lse [B, H, T] (the log2-domain log-sum-exp of
  each query's scaled scores, as `mha` keeps it): the backward kernels alone, partitioned on a
  mesh. Only where `partitioned_backward_available`."""
  seg = segment_ids is not None
  res = (q, k, v) + ((segment_ids,) if seg else ()) + (out, lse, do)
  return _calls(float(sm_scale), bool(interpret), seg)[1](*res)


def _rule(seg: bool, kind: str) -> str:
  ins = ["b t h d", "b s h d", "b s h d"] + (["b s"] if seg else [])
  if kind == "fwd":
    return ", ".join(ins) + " -> b t h d, b h t"
  return ", ".join(ins + ["b t h d", "b h t", "b t h d"]) + " -> b t h d, b s h d, b s h d"


@functools.lru_cache(maxsize=None)
def _calls(sm_scale: float, interpret: bool, seg: bool):
  f, bwd = _kernels()
  blocks = inspect.signature(f.mha).parameters["block_sizes"].default

  def fwd(q, k, v, *s):
    out, lse = f.mha(
      q,
      k,
      v,
      s[0] if seg else None,
      sm_scale=sm_scale,
      causal=True,
      interpret=interpret,
      return_residuals=True,
    )
    return out, lse

  def bwd_local(q, k, v, *rest):
    s, (out, lse, do) = (rest[0] if seg else None), rest[-3:]
    res = (q, k, v, s, out, lse)
    dq, dk, dv, _ = bwd(sm_scale, True, blocks, "triton", None, 2, None, interpret, False, False, res, do)  # fmt: skip
    return dq, dk, dv

  whole = {"t": _WHOLE, "s": _WHOLE, "d": _WHOLE}
  return (
    partition.sharded(fwd, _rule(seg, "fwd"), block=whole),
    partition.sharded(bwd_local, _rule(seg, "bwd"), block=whole),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend(q, k, v, sm_scale, interpret):
  return _calls(sm_scale, interpret, False)[0](q, k, v)[0]


def _attend_fwd(q, k, v, sm_scale, interpret):
  out, lse = _calls(sm_scale, interpret, False)[0](q, k, v)
  return out, (q, k, v, out, lse)


def _attend_bwd(sm_scale, interpret, res, do):
  return _calls(sm_scale, interpret, False)[1](*res, do)


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend_seg(q, k, v, seg, sm_scale, interpret):
  return _calls(sm_scale, interpret, True)[0](q, k, v, seg)[0]


def _attend_seg_fwd(q, k, v, seg, sm_scale, interpret):
  out, lse = _calls(sm_scale, interpret, True)[0](q, k, v, seg)
  return out, (q, k, v, seg, out, lse)


def _attend_seg_bwd(sm_scale, interpret, res, do):
  dq, dk, dv = _calls(sm_scale, interpret, True)[1](*res, do)
  return dq, dk, dv, None


_attend_seg.defvjp(_attend_seg_fwd, _attend_seg_bwd)
