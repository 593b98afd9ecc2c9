"""A decode step's attention in one Pallas kernel (a GPU's; interpret mode on the CPU).

One query a row attends to the first `n_slots` slots of a row's KV cache: one program per
(row, query head) reads its kv head's keys and values in chunks of CHUNK slots with an
online float32 softmax (scores q.k of compute-dtype values summed in float32, unnormalised
probabilities rounded to the compute dtype before the p.v sum, as `attention.attend` rounds
its probabilities), and writes the head's [Dh] output. XLA's form of the same step
(`attention.attend_one`) is three kernels a layer (the scores, the softmax, the p.v sum);
this is one, and it reads only the slots it attends (`n_slots`) with no copy of them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

CHUNK = 64  # slots a step of the kernel's loop reads
MASK_VALUE = -1e30  # as attention.MASK_VALUE


def supported(n_slots: int, head_dim: int) -> bool:
  """Whether the kernel takes this step: whole chunks of slots, a power-of-two head size."""
  return n_slots % CHUNK == 0 and n_slots > 0 and head_dim & (head_dim - 1) == 0


def _kernel(q_ref, k_ref, v_ref, m_ref, o_ref, *, n_chunks: int, scale: float, cd):
  f32 = jnp.float32
  q = q_ref[...].astype(cd).astype(f32)  # [Dh]

  def body(i, carry):
    m, total, acc = carry
    at = pl.ds(pl.multiple_of(i * CHUNK, CHUNK), CHUNK)
    k = k_ref[at, :].astype(cd).astype(f32)  # [CHUNK, Dh]
    s = jnp.sum(k * q[None, :], axis=1) * f32(scale)
    s = jnp.where(m_ref[at] != 0, s, f32(MASK_VALUE))
    m_new = jnp.maximum(m, jnp.max(s))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    v = v_ref[at, :].astype(cd).astype(f32)
    pv = jnp.sum(p.astype(cd).astype(f32)[:, None] * v, axis=0)
    return m_new, total * corr + jnp.sum(p), acc * corr + pv

  dh = q.shape[0]
  init = (f32(MASK_VALUE), f32(0.0), jnp.zeros((dh,), f32))
  _, total, acc = jax.lax.fori_loop(0, n_chunks, body, init)
  o_ref[...] = (acc / total).astype(o_ref.dtype)


def decode_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  n_slots: int,
  cd,
  *,
  interpret: bool = False,
) -> jax.Array:
  """q [B, 1, H, Dh]; k, v [B, Hkv, S, Dh] (the whole cache); mask [B, S] (the slots the
  query may see; only the first n_slots are read). Returns [B, 1, H * Dh] in cd."""
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  if t != 1 or not supported(n_slots, dh) or n_slots > s:
    raise ValueError(
      f"decode_attention: one query a row, n_slots a multiple of {CHUNK} up to the cache's "
      f"{s} slots and a power-of-two head size; got q {q.shape}, n_slots {n_slots}"
    )
  g = h // hkv
  out = pl.pallas_call(
    functools.partial(_kernel, n_chunks=n_slots // CHUNK, scale=float(dh**-0.5), cd=cd),
    out_shape=jax.ShapeDtypeStruct((b, h, dh), cd),
    grid=(b, h),
    in_specs=[
      pl.BlockSpec((None, None, dh), lambda i, j: (i, j, 0)),
      pl.BlockSpec((None, None, s, dh), lambda i, j: (i, j // g, 0, 0)),
      pl.BlockSpec((None, None, s, dh), lambda i, j: (i, j // g, 0, 0)),
      pl.BlockSpec((None, s), lambda i, j: (i, 0)),
    ],
    out_specs=pl.BlockSpec((None, None, dh), lambda i, j: (i, j, 0)),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="decode_attention",
  )(q.reshape(b, h, dh), k, v, mask.astype(jnp.int32))
  return out.reshape(b, 1, h * dh)
