"""Batch-invariant attention for GPUs (Pallas, lowered through Triton): `jet_exact`'s attention
where a GPU computes it (`Plan`'s "invariant" attention and cache-step attention).

One kernel serves the training forward's causal attention (`attend_causal`), a rollout's
prefill and each decode step over the KV cache (`attend_cache`), with one computation for a
query whatever the call around it:

  - a row's keys are read in blocks of BK slots counted from its first attended slot (its
    first real token): block j holds slots start + j BK ... start + (j + 1) BK - 1, so more or
    less left padding, a longer cache or another prompt width moves no key to another place
    in its block;
  - each block: the scores q.k of compute-dtype operands in float32, scaled by Dh^-1/2, masked
    keys set to MASK_VALUE; the online softmax's running max m, the block's probabilities
    exp(s - m), the running sum l and the float32 accumulator of p.v (p rounded to the compute
    dtype, as `attention.attend` rounds its probabilities) rescaled by exp(m_old - m), block
    after block in order j = 0, 1, 2, ...; the output acc / l in the compute dtype;
  - one query tile (BQ rows) and one key block (BK) in every call, the same warps: a row's
    dots and reductions are the same instructions in every program. The tile's rows are the
    queries of one kv head's group of query heads (row g T + t: head g of the group, query
    t), so a decode step's G queries of a kv head read its keys and values once.
Which keys a query sees is computed in the kernel, not read from a mask: query t of row b
sees slot s when key_mask[b, s] is set and s <= q_start[b] + t (the causal rule, the query's
own slot counted from q_start). A tile reads the blocks up to its last query's slot and no
further; blocks past a query's last visible key would add exact zeros (probabilities
exp(-1e30 - m) = 0, rescale exp(0) = 1), so the training forward's tiles (which read blocks of
their later queries), a decode step's cache (whose last block holds empty or absent slots,
loaded as zeros) and the prefill compute token t's output bit for bit alike. The cache is read
in place: slots past its end load as zeros, so no step pads or copies it.

A query that sees no key (a pad token) gets an output of zeros where no block was read, else
the mean of the block's values; either is finite and ignored.

The backward (`attend_causal`): the flash-attention kernels' (`kernels.flash`, jet's), fed the
forward's outputs and log-sum-exp, or, where those kernels do not take the shapes, the
standard attention's (`attention.attend`) autodiff; only the forward values are this kernel's.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.exact_math import with_reference_vjp

BQ = 64  # query rows a program
BK = 64  # key slots a block
MASK_VALUE = -1e30
LOG2E = math.log2(math.e)


class Slots(NamedTuple):
  """Which keys each row's queries see (`slots`): key_mask [B, S] int32 (1: a real token),
  start [Bp] int32 (the row's first attended slot: where its blocks start), q_start [Bp] int32
  (the slot of the row's query 0); Bp = B rounded up to a power of two (Triton's blocks)."""

  key_mask: jax.Array
  start: jax.Array
  q_start: jax.Array


def slots(key_mask, q_start, t: int) -> Slots:
  """`Slots` of rows whose T queries sit at slots q_start + t (q_start: int32 [B] or a scalar)
  over keys key_mask [B, S] (bool or int). Computed once a step, shared by its layers."""
  b, s = key_mask.shape
  q_start = jnp.broadcast_to(jnp.asarray(q_start, jnp.int32), (b,))
  seen = (key_mask != 0) & (jnp.arange(s, dtype=jnp.int32)[None, :] <= (q_start + t - 1)[:, None])
  # The first attended slot of each row (an order-free min): where its blocks start.
  start = jnp.where(jnp.any(seen, axis=1), jnp.argmax(seen, axis=1), 0).astype(jnp.int32)
  bp = 1 << max(0, b - 1).bit_length()
  pad = lambda a: jnp.pad(a, (0, bp - b))
  return Slots(key_mask.astype(jnp.int32), pad(start), pad(q_start))


def _kernel(start_ref, q0_ref, km_ref, q_ref, k_ref, v_ref, o_ref, *lse_ref, t, rows, s, scale, cd):
  b, r = pl.program_id(0), pl.program_id(2)
  start, q0 = start_ref[b], q0_ref[b]
  f32 = jnp.float32
  row = r * BQ + jnp.arange(BQ, dtype=jnp.int32)
  live = row < rows
  q = plgpu.load(q_ref.at[pl.ds(r * BQ, BQ), :], mask=live[:, None], other=0.0)  # [BQ, Dh]
  q_slot = q0 + lax.rem(row, jnp.int32(t))
  hi = jnp.minimum(jnp.max(q_slot), s - 1)  # the tile's last visible slot
  nb = lax.div(jnp.maximum(hi - start + BK, 0), jnp.int32(BK))  # blocks start .. hi

  def body(j, carry):
    m, den, acc = carry
    off = start + j * BK
    slot = off + jnp.arange(BK, dtype=jnp.int32)
    inside = slot < s
    k = plgpu.load(k_ref.at[pl.ds(off, BK), :], mask=inside[:, None], other=0.0)
    v = plgpu.load(v_ref.at[pl.ds(off, BK), :], mask=inside[:, None], other=0.0)
    real = plgpu.load(km_ref.at[pl.ds(off, BK)], mask=inside, other=0)
    sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * f32(scale)
    ok = (real != 0)[None, :] & (slot[None, :] <= q_slot[:, None])
    sc = jnp.where(ok, sc, f32(MASK_VALUE))
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    den = den * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(cd), v, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    return m_new, den, acc * alpha[:, None] + pv

  dh = q.shape[1]
  init = (jnp.full((BQ,), -jnp.inf, f32), jnp.zeros((BQ,), f32), jnp.zeros((BQ, dh), f32))
  m, den, acc = lax.fori_loop(0, nb, body, init)
  some = den > 0
  out = jnp.where(some[:, None], acc / jnp.where(some, den, 1.0)[:, None], 0.0)
  plgpu.store(o_ref.at[pl.ds(r * BQ, BQ), :], out.astype(o_ref.dtype), mask=live[:, None])
  if lse_ref:  # the log2-domain log-sum-exp the flash backward reads; +inf: a query seeing none
    saw = m > f32(MASK_VALUE / 2)
    lse = jnp.where(saw, (m + jnp.log(jnp.where(some, den, 1.0))) * f32(LOG2E), jnp.inf)
    lse_ref[0][...] = lse


def _call(qr, k, v, sl: Slots, t: int, cd, interpret: bool, kv_layout: str, with_lse: bool):
  """The kernel over queries qr [B, Hkv, G T, Dh] (row g T + t) and keys / values in
  kv_layout "bhsd" ([B, Hkv, S, Dh], the cache's) or "bshd" ([B, S, Hkv, Dh], the
  projections'). Returns the output [B, Hkv, G T, Dh] (and the log2 lse [B, Hkv, G T_p])."""
  b, hkv, rows, dh = qr.shape
  s = k.shape[2] if kv_layout == "bhsd" else k.shape[1]
  nr = -(-rows // BQ)
  bp = sl.start.shape[0]
  if kv_layout == "bhsd":
    kv_spec = pl.BlockSpec((None, None, s, dh), lambda i, h, r: (i, h, 0, 0))
  else:
    kv_spec = pl.BlockSpec((None, s, None, dh), lambda i, h, r: (i, 0, h, 0))
  row_spec = pl.BlockSpec((None, None, rows, dh), lambda i, h, r: (i, h, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((b, hkv, rows, dh), cd)]
  out_specs = [row_spec]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((b, hkv, nr * BQ), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, BQ), lambda i, h, r: (i, h, r)))
  kernel = functools.partial(_kernel, t=t, rows=rows, s=s, scale=float(dh**-0.5), cd=cd)
  return pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(b, hkv, nr),
    in_specs=[
      pl.BlockSpec((bp,), lambda i, h, r: (0,)),
      pl.BlockSpec((bp,), lambda i, h, r: (0,)),
      pl.BlockSpec((None, s), lambda i, h, r: (i, 0)),
      row_spec,
      kv_spec,
      kv_spec,
    ],
    out_specs=out_specs,
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="invariant_attention",
  )(sl.start, sl.q_start, sl.key_mask, qr.astype(cd), k.astype(cd), v.astype(cd))


def _rows(q, hkv: int):
  """q [B, T, H, Dh] -> [B, Hkv, G T, Dh], row g T + t (a reshape alone when T = 1)."""
  b, t, h, dh = q.shape
  g = h // hkv
  if t == 1:
    return q.reshape(b, hkv, g, dh)
  return jnp.transpose(q.reshape(b, t, hkv, g, dh), (0, 2, 3, 1, 4)).reshape(b, hkv, g * t, dh)


def _unrows(o, t: int):
  """[B, Hkv, G T, Dh] -> [B, T, H Dh] (`_rows`' inverse, heads merged)."""
  b, hkv, rows, dh = o.shape
  g = rows // t
  if t == 1:
    return o.reshape(b, 1, hkv * g * dh)
  o = jnp.transpose(o.reshape(b, hkv, g, t, dh), (0, 3, 1, 2, 4))
  return o.reshape(b, t, hkv * g * dh)


def attend_cache(q, k, v, sl: Slots, cd, *, interpret: bool):
  """Attention of T new queries q [B, T, H, Dh] over a cache's keys and values k, v
  [B, Hkv, S, Dh], read in place, with the rows' `Slots` (`slots(mask, index, T)`).
  Returns [B, T, H * Dh] in cd. No backward (a rollout's)."""
  t = q.shape[1]
  out = _call(_rows(q, k.shape[1]), k, v, sl, t, cd, interpret, "bhsd", False)[0]
  return _unrows(out, t)


def attend_causal(
  q, k, v, attention_mask: Optional[jax.Array], cd, *, interpret: bool, flash_backward, reference
):
  """The training forward's causal attention: q [B, T, H, Dh]; k, v [B, T, Hkv, Dh] (the
  projections' layout); attention_mask [B, T] (1 for a real token) or None. Query t sees the
  real keys at or before it, as `models.attention.causal_mask`. Returns [B, T, H * Dh] in cd.

  flash_backward: `attention.attend_flash_backward` (jet's flash-attention backward kernels,
  fed this forward's output and log-sum-exp), or None: the backward is `reference`'s
  (`attention.attend` over the causal mask) autodiff."""
  b, t = q.shape[:2]
  real = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask
  real = real.astype(jnp.int32)
  if flash_backward is not None:
    return _causal(q, k, v, real, cd, interpret, flash_backward)

  def ref(q, k, v, real):
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & (real != 0)[:, None, :]
    return reference(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), allowed, cd)

  fwd = lambda q, k, v, real: _causal_forward(q, k, v, real, cd, interpret, False)[0]
  return with_reference_vjp(fwd, ref, q, k, v, real)


def _causal_forward(q, k, v, real, cd, interpret: bool, with_lse: bool):
  t = q.shape[1]
  sl = slots(real, jnp.zeros((), jnp.int32), t)
  out = _call(_rows(q, k.shape[2]), k, v, sl, t, cd, interpret, "bshd", with_lse)
  return _unrows(out[0], t), out[1:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _causal(q, k, v, real, cd, interpret, flash_backward):
  return _causal_forward(q, k, v, real, cd, interpret, False)[0]


def _causal_fwd(q, k, v, real, cd, interpret, flash_backward):
  out, (lse,) = _causal_forward(q, k, v, real, cd, interpret, True)
  b, t, h, _ = q.shape
  lse = lse[:, :, : h // k.shape[2] * t].reshape(b, h, t)  # row g T + t: head (kv, g), query t
  lse = jnp.where(real[:, None, :] != 0, lse, jnp.inf)  # a pad query reaches no loss
  return out, (q, k, v, real, out, lse)


def _causal_bwd(cd, interpret, flash_backward, res, do):
  q, k, v, real, out, lse = res
  shape = q.shape
  dq, dk, dv = flash_backward(
    q, k, v, real, out.reshape(shape), lse, do.reshape(shape), cd
  )  # fmt: skip
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_causal.defvjp(_causal_fwd, _causal_bwd)
