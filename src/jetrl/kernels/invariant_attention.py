"""Batch-invariant attention for GPUs (Pallas, lowered through Triton): `jet_exact`'s attention
where a GPU computes it (`Plan`'s "invariant" attention and cache-step attention).

One kernel serves the training forward's causal attention, a rollout's prefill and each decode
step over the KV cache, with one computation for a query whatever the call around it:

  - the keys are read in blocks of BK slots counted from the row's first attended slot (its
    first real token): block j holds slots start + j BK ... start + (j + 1) BK - 1, so more or
    less left padding, a longer cache or another prompt width moves no key to another place
    in its block;
  - each block: the scores q.k of compute-dtype operands in float32, scaled by Dh^-1/2, masked
    keys set to MASK_VALUE; the online softmax's running max m, the block's probabilities
    exp(s - m), the running sum l and the float32 accumulator of p.v (p rounded to the compute
    dtype, as `attention.attend` rounds its probabilities) rescaled by exp(m_old - m), block
    after block in order j = 0, 1, 2, ...; the output acc / l in the compute dtype;
  - one query tile (BQ rows: a decode step's one query padded with zeros) and one key block
    (BK) in every call, the same warps: a row's dots and reductions are the same instructions
    in every program.
Blocks past a query's last visible key add exact zeros (their probabilities are exp(-1e30 - m)
= 0 and the rescale factor is exp(0) = 1), so the training forward's blocks of future tokens,
a decode step's empty cache slots and the padding to whole blocks change no bit: token t's
output is the same in all three. Masked keys' values must be finite (0 x Inf is NaN): a cache
starts as zeros.

The backward is the standard attention's (`attention.attend`, JAX's autodiff), evaluated on the
same inputs: only the forward values are the kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.precision.exact_math import with_reference_vjp

BQ = 64  # query rows a program
BK = 64  # key slots a block
MASK_VALUE = -1e30


def _kernel(start_ref, q_ref, k_ref, v_ref, ok_ref, o_ref, *, scale: float, nb: int, cd):
  b = pl.program_id(0)
  start = start_ref[b]
  q = q_ref[...]  # [BQ, Dh] in cd
  f32 = jnp.float32

  def body(j, carry):
    m, den, acc = carry
    off = start + j * BK
    k = k_ref[pl.ds(off, BK), :]
    v = v_ref[pl.ds(off, BK), :]
    ok = ok_ref[:, pl.ds(off, BK)]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * f32(scale)
    s = jnp.where(ok != 0, s, f32(MASK_VALUE))
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    den = den * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(cd), v, (((1,), (0,)), ((), ())), preferred_element_type=f32)
    return m_new, den, acc * alpha[:, None] + pv

  bq, dh = q.shape
  init = (jnp.full((bq,), -jnp.inf, f32), jnp.zeros((bq,), f32), jnp.zeros((bq, dh), f32))
  _, den, acc = lax.fori_loop(0, nb, body, init)
  o_ref[...] = (acc / den[:, None]).astype(o_ref.dtype)


def _attend(q, k, v, allowed, cd, interpret: bool):
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  g = h // hkv
  # The first attended slot of each row (an order-free min): where its blocks start.
  seen = jnp.any(allowed, axis=1)  # [B, S]
  start = jnp.where(jnp.any(seen, axis=1), jnp.argmax(seen, axis=1), 0).astype(jnp.int32)
  nb = -(-s // BK)
  tp = -(-t // BQ) * BQ
  sp = s + nb * BK  # every block of every start stays inside the arrays
  qh = jnp.pad(jnp.transpose(q.astype(cd), (0, 2, 1, 3)), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
  kp = jnp.pad(k.astype(cd), ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  vp = jnp.pad(v.astype(cd), ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  okp = jnp.pad(allowed.astype(jnp.int8), ((0, 0), (0, tp - t), (0, sp - s)))
  bp = 1 << max(0, b - 1).bit_length()  # Triton's blocks: powers of two
  start = jnp.pad(start, (0, bp - b))
  out = pl.pallas_call(
    functools.partial(_kernel, scale=float(dh**-0.5), nb=nb, cd=cd),
    out_shape=jax.ShapeDtypeStruct((b, h, tp, dh), cd),
    grid=(b, h, tp // BQ),
    in_specs=[
      pl.BlockSpec((bp,), lambda i, j, r: (0,)),
      pl.BlockSpec((None, None, BQ, dh), lambda i, j, r: (i, j, r, 0)),
      pl.BlockSpec((None, None, sp, dh), lambda i, j, r: (i, j // g, 0, 0)),
      pl.BlockSpec((None, None, sp, dh), lambda i, j, r: (i, j // g, 0, 0)),
      pl.BlockSpec((None, BQ, sp), lambda i, j, r: (i, r, 0)),
    ],
    out_specs=pl.BlockSpec((None, None, BQ, dh), lambda i, j, r: (i, j, r, 0)),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="invariant_attention",
  )(start, qh, kp, vp, okp)
  return jnp.transpose(out[:, :, :t], (0, 2, 1, 3)).reshape(b, t, h * dh)


def attend(q, k, v, allowed, cd, *, interpret: bool, reference):
  """Masked GQA attention with the shapes and meaning of `attention.attend` (`reference`, whose
  autodiff is the backward): q [B, T, H, Dh]; k, v [B, Hkv, S, Dh]; allowed [B, T, S] bool.
  Returns [B, T, H * Dh] in cd."""
  return with_reference_vjp(
    lambda *a: _attend(*a, cd=cd, interpret=interpret),
    lambda *a: reference(*a, cd),
    q,
    k,
    v,
    allowed,
  )
