"""Grouped-query attention's arithmetic: the masked softmax of q.k in float32 and its product
with v (`attend`), as reductions for one query a row on a GPU (`attend_one`), in the Pallas
flash-attention kernel (`attend_flash`), and over a batch-invariant gridded cache
(`write_grids`, `attend_grids`; exact_ops). Queries of kv-group g (heads g*G .. g*G+G-1,
G = n_heads // n_kv_heads) share kv head g. Masked scores are set to a large negative finite
value (not -inf), so a query with nothing to attend to (a pad token) gets a finite, ignored
output instead of NaN; NaN / Inf in the inputs still propagate.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.kernels import decode_attention as _da
from jetrl.kernels import cpu_kernels as _cpu_kernels
from jetrl.kernels import exact_ops
from jetrl.kernels.device import Device, current_device
from jetrl.kernels.flash import flash_attention, flash_backward
from jetrl.precision import Precision
from jetrl.precision.formats import dot_precision

MASK_VALUE = -1e30


def heads_first(x: jax.Array) -> jax.Array:
  """[B, T, Hkv, Dh] -> [B, Hkv, T, Dh], the layout `attend` takes keys and values in."""
  return jnp.swapaxes(x, 1, 2)


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  allowed: jax.Array,
  cd,
  exact: bool = False,
  dev: Optional[Device] = None,
) -> jax.Array:
  """Masked GQA attention.

  q [B, T, H, Dh]; k, v [B, Hkv, S, Dh] (kv heads before slots, the KV cache's layout);
  allowed [B, T, S] bool (query t may see key s). Returns [B, T, H * Dh] in cd.
  exact: the batch-invariant forward (exact sums; kernels/exact_ops.py). dev: the device
  traced for (default: `current_device()`); compiled for a GPU, one query a row attends as
  reductions (`attend_one`).
  """
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  chex.assert_shape(k, (b, hkv, s, dh))
  chex.assert_shape(v, (b, hkv, s, dh))
  chex.assert_shape(allowed, (b, t, s))
  dev = current_device() if dev is None else dev
  if exact:
    kernel = _cpu_kernels.usable(dev)
    return exact_ops.attend(q, k, v, allowed, cd, reference=attend, kernel=kernel)
  if t == 1 and dev.gpu:
    return attend_one(q, k, v, allowed, cd)
  g = h // hkv
  qg = q.reshape(b, t, hkv, g, dh)
  prec = dot_precision(cd)
  scores = jnp.einsum(
    "btkgd,bksd->bkgts",
    qg.astype(cd),
    k.astype(cd),
    precision=prec,
    preferred_element_type=jnp.float32,
  )
  scores = scores * jnp.float32(dh**-0.5)
  scores = jnp.where(allowed[:, None, None, :, :], scores, jnp.float32(MASK_VALUE))
  probs = jax.nn.softmax(scores, axis=-1).astype(cd)
  # Heads-major output, then one transpose of the small result: asking the dot for
  # [B, T, Hkv, G, Dh] directly makes XLA's CPU dot several times slower at decode sizes.
  out = jnp.einsum(
    "bkgts,bksd->bkgtd", probs, v.astype(cd), precision=prec, preferred_element_type=jnp.float32
  )
  return jnp.transpose(out.astype(cd), (0, 3, 1, 2, 4)).reshape(b, t, h * dh)


def attend_one(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, cd) -> jax.Array:
  """`attend` for one query per row (a decode step), written as reductions instead of dots.

  The same arithmetic as `attend` (q.k and p.v products of compute-dtype values summed in
  float32, the float32 softmax, its probabilities rounded to cd), summed in another order.
  On a GPU the two dots of a decode step are tiny batched GEMMs ([G, Dh] x [Dh, S] per row
  and kv head), each a cuBLAS call that ends the step's CUDA graph, with the masked softmax
  between them in three more kernels; as reductions XLA fuses the scores, the softmax and
  the p.v sum into three kernels inside the graph (docs/benchmarks.md, "Compiled programs").
  On a CPU the dots are faster, so `attend` takes this form only when compiling for a GPU.
  """
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  chex.assert_equal(t, 1)
  chex.assert_shape(allowed, (b, 1, s))
  g = h // hkv
  f32 = jnp.float32
  qg = q.reshape(b, hkv, g, 1, dh).astype(cd).astype(f32)
  scores = jnp.sum(qg * k.astype(cd).astype(f32)[:, :, None], axis=-1)  # [B, Hkv, G, S]
  scores = scores * f32(dh**-0.5)
  scores = jnp.where(allowed[:, None, :, :], scores, f32(MASK_VALUE))
  probs = jax.nn.softmax(scores, axis=-1).astype(cd).astype(f32)
  out = jnp.sum(probs[..., None] * v.astype(cd).astype(f32)[:, :, None], axis=-2)  # [B,Hkv,G,Dh]
  return out.astype(cd).reshape(b, 1, h * dh)


def use_decode_kernel(n_slots: int, head_dim: int, dev: Optional[Device] = None) -> bool:
  """Whether a decode step (one query a row, not the batch-invariant forward) attends with
  the one-kernel `decode_attention.decode_attention`: compiling for a GPU, and the shapes it
  takes (whole chunks of slots); else `attend` (on a GPU, `attend_one`)."""
  return (current_device() if dev is None else dev).gpu and _da.supported(n_slots, head_dim)


# A training forward of at least this many tokens a row attends with the Pallas
# flash-attention kernel when compiled for a GPU (`use_flash`); its tiles are this long.
FLASH_BLOCK = 128


def use_flash(
  precision: Optional[Precision], t: int, head_dim: int, cd, dev: Optional[Device] = None
) -> bool:
  """Whether a forward over T tokens a row attends with `attend_flash`: compiling for a GPU,
  a 16-bit compute dtype cd (the kernel's dots on float32 operands are TF32 on a GPU, and a
  float32 model stays float32: it attends with `attend`, whose dots are HIGHEST), not the
  batch-invariant forward (its exact sums are its own), T at least FLASH_BLOCK and a
  power-of-two head size (the kernel's tiles)."""
  return (
    (current_device() if dev is None else dev).gpu
    and jnp.dtype(cd).itemsize == 2
    and not (isinstance(precision, Precision) and precision.batch_invariant)
    and t >= FLASH_BLOCK
    and head_dim & (head_dim - 1) == 0
  )


def attend_flash(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  attention_mask: Optional[jax.Array],
  cd,
  *,
  interpret=False,
  dev: Optional[Device] = None,
) -> jax.Array:
  """Causal GQA self-attention of a whole sequence with JAX's Pallas flash-attention kernel
  (`jax.experimental.pallas.ops.gpu.attention.mha`, forward and backward).

  q [B, T, H, Dh], k, v [B, T, Hkv, Dh] (the projections' layout, before `heads_first`);
  attention_mask [B, T] (1 for a real token) or None. Returns [B, T, H * Dh] in cd.

  `attend` materialises the [B, H, T, T] scores, their softmax and, in the backward, their
  gradients: on a GPU most of the update's non-GEMM traffic (docs/benchmarks.md, "Compiled
  programs"). The kernel keeps each block of scores on chip. Padding is a segment (segment 0,
  real tokens 1), so a real query sees exactly the real keys at or before it, as under
  `causal_mask`; a pad query sees the pads before it instead of nothing (its output is
  ignored either way). Softmax in float32, online; kv heads are repeated to the query heads
  (the kernel takes one kv head per query head) and their gradients summed back by JAX. T is
  padded at the end to whole tiles: causal, no real query sees those keys. On a mesh each
  device attends over its own rows and heads (`jetrl.kernels.flash`).
  """
  b, t, h, dh = q.shape
  g = h // k.shape[2]
  tp = -(-t // FLASH_BLOCK) * FLASH_BLOCK
  pad = lambda a: a if tp == t else jnp.pad(a, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  q, k, v = (pad(a.astype(cd)) for a in (q, k, v))
  if g > 1:
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  seg = None
  if attention_mask is not None:
    seg = jnp.pad(attention_mask.astype(jnp.int32), ((0, 0), (0, tp - t)))
  interpret = interpret or (current_device() if dev is None else dev).interpret  # run here
  out = flash_attention(q, k, v, seg, float(dh**-0.5), interpret)  # partitioned on a mesh
  return out[:, :t].reshape(b, t, h * dh)


def attend_flash_backward(q, k, v, segment_ids, out, lse, do, cd, *, interpret=False):
  """(dq, dk, dv) of `attend_flash`'s attention from a forward's outputs, in the flash
  kernels' backward (`flash.flash_backward`): q, out, do [B, T, H, Dh]; k, v [B, T, Hkv, Dh];
  segment_ids [B, T] (1 for a real token) or None; lse [B, H, T], each query's log2-domain
  log-sum-exp of its scaled scores (+inf for a query whose gradient is zero). As
  `attend_flash`, T is padded to whole tiles (those queries' lse +inf) and the kv heads are
  repeated to the query heads, their gradients summed back."""
  b, t, h, dh = q.shape
  hkv = k.shape[2]
  g = h // hkv
  tp = -(-t // FLASH_BLOCK) * FLASH_BLOCK
  pad = lambda a: a if tp == t else jnp.pad(a, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  q, k, v, out, do = (pad(a.astype(cd)) for a in (q, k, v, out, do))
  lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, tp - t)), constant_values=jnp.inf)
  if segment_ids is not None:
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)))
  if g > 1:
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  dq, dk, dv = flash_backward(q, k, v, segment_ids, out, lse, do, float(dh**-0.5), interpret)
  if g > 1:  # summed over each kv head's group, as the repeat's autodiff sums them
    dk, dv = (a.reshape(b, tp, hkv, g, dh).sum(axis=3, dtype=a.dtype) for a in (dk, dv))
  return dq[:, :t], dk[:, :t], dv[:, :t]


def write_grids(
  k_cache: jax.Array, v_cache: jax.Array, e_cache: jax.Array, k: jax.Array, v: jax.Array, start, cd
):
  """A gridded KV cache's layer (`KVCache.v_exp`) with new keys and values k, v
  [B, Hkv, T, Dh] written at `start`: each rounded to its grid once, here (exact_ops).

  The key / value is first cast to the cache's dtype, as a plain cache stores it, so the
  grid is that of the value a plain cache would hold.
  """
  kg = exact_ops.grid_keys(k.astype(k_cache.dtype), cd)
  vg, fv = exact_ops.grid_values(v.astype(v_cache.dtype), cd)
  update = jax.lax.dynamic_update_slice
  return (
    update(k_cache, kg.astype(k_cache.dtype), start),
    update(v_cache, vg.astype(v_cache.dtype), start),
    update(e_cache, fv, start),
  )


def attend_grids(
  q: jax.Array, kg: jax.Array, vg: jax.Array, fv: jax.Array, allowed: jax.Array, cd, dev: Device
) -> jax.Array:
  """`attend(..., exact=True)` over a gridded cache's keys kg, values vg and value exponents
  fv [B, Hkv, S, 1] (`write_grids`): the same values, without re-gridding the cache; on the
  CPU kernels where `dev` can run them."""
  kernel = _cpu_kernels.usable(dev)
  return exact_ops.attend_grids(q, kg, vg, fv, allowed, cd, reference=attend, kernel=kernel)
