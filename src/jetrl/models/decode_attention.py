"""A decode step's attention in one Pallas kernel (a GPU's; interpret mode on the CPU).

One query a row attends to the first `n_slots` slots of a row's KV cache: one program per
(row, query head) reads its kv head's keys and values in chunks of CHUNK slots with an
online float32 softmax (scores q.k of compute-dtype values summed in float32, unnormalised
probabilities rounded to the compute dtype before the p.v sum, as `attention.attend` rounds
its probabilities), and writes the head's [Dh] output. XLA's form of the same step
(`attention.attend_one`) is three kernels a layer (the scores, the softmax, the p.v sum);
this is one, and it reads only the slots it attends (`n_slots`) with no copy of them.

`decode_step_attention` takes more of the layer into the same kernel: the fused q / k / v
projection's bias, RoPE, and the new key and value written into the cache (in place, by the
first query head of each kv group); the new slot's key and value enter the online softmax
from registers, so no program reads a slot another is writing. Under an FP8 rollout it also
writes its output quantized (one head's output is one 1 x 128 group), for the o projection
(models/decode_fused.py). Both kernels carry their slot count in their name
(`decode_attention_<n>slots`), from which the compile report counts the bytes they read
(jetrl.aot.kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.precision import quant_kernel as _qk

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
    name=f"decode_attention_{n_slots}slots",  # read by jetrl.aot.kernels
  )(q.reshape(b, h, dh), k, v, mask.astype(jnp.int32))
  return out.reshape(b, 1, h * dh)


def _rope_halves(x1, x2, c1, c2, s1, s2, cd):
  """`layers.apply_rope` of one head given as halves (float32 holding cd values), with its
  rounding points: x * cos and rotated * sin each rounded to cd, then their sum."""
  r = lambda a: a.astype(cd).astype(jnp.float32)
  return r(r(x1 * c1) + r(-x2 * s1)), r(r(x2 * c2) + r(x1 * s2))


def _step_kernel(*refs, g: int, n_chunks: int, scale: float, cd, bias: bool, quant, interpret):
  f32 = jnp.float32
  refs = list(refs)
  take = lambda n: [refs.pop(0) for _ in range(n)]
  yq_ref, yk_ref, yv_ref = take(3)
  bq_ref, bk_ref, bv_ref = take(3) if bias else (None, None, None)
  cos_ref, sin_ref, idx_ref, m_ref, k_ref, v_ref = take(6)
  outs = refs[:-2]  # (o,) or (q, s_t): the attention output; the caches' outputs follow
  ko_ref, vo_ref = refs[-2:]
  dh = yq_ref.shape[-1]
  half = dh // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  r = lambda a: a.astype(cd).astype(f32)

  def head(y_ref, b_ref, part):
    x = y_ref[part].astype(f32)
    return x if b_ref is None else r(x + b_ref[part].astype(f32))  # y + bias, in cd

  c1, c2 = cos_ref[lo].astype(f32), cos_ref[hi].astype(f32)
  s1, s2 = sin_ref[lo].astype(f32), sin_ref[hi].astype(f32)
  q1, q2 = _rope_halves(head(yq_ref, bq_ref, lo), head(yq_ref, bq_ref, hi), c1, c2, s1, s2, cd)
  k1, k2 = _rope_halves(head(yk_ref, bk_ref, lo), head(yk_ref, bk_ref, hi), c1, c2, s1, s2, cd)
  v_new = head(yv_ref, bv_ref, pl.ds(0, dh))
  idx = idx_ref[0]

  # The new token's key and value go into slot idx of its kv head, written once (by the
  # group's first query head); every query head takes them from registers, not the cache.
  @pl.when(pl.program_id(1) % g == 0)
  def _():
    row = pl.ds(idx, 1)
    ko_ref[row, lo] = k1[None, :].astype(ko_ref.dtype)
    ko_ref[row, hi] = k2[None, :].astype(ko_ref.dtype)
    vo_ref[row, :] = v_new[None, :].astype(vo_ref.dtype)

  # The new slot first (an online softmax's first term), masked as its own mask says.
  s_new = (jnp.sum(q1 * r(k1)) + jnp.sum(q2 * r(k2))) * f32(scale)
  s_new = jnp.where(m_ref[idx] != 0, s_new, f32(MASK_VALUE))
  init = (s_new, f32(1.0), r(v_new))

  def body(i, carry):
    m, total, acc = carry
    start = pl.multiple_of(i * CHUNK, CHUNK)
    at = pl.ds(start, CHUNK)
    s = jnp.sum(r(k_ref[at, lo]) * q1[None, :], axis=1) + jnp.sum(
      r(k_ref[at, hi]) * q2[None, :], axis=1
    )
    s = s * f32(scale)
    slots = start + jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    s = jnp.where((m_ref[at] != 0) & (slots != idx), s, f32(MASK_VALUE))
    m_new = jnp.maximum(m, jnp.max(s))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    pv = jnp.sum(r(p)[:, None] * r(v_ref[at, :]), axis=0)
    return m_new, total * corr + jnp.sum(p), acc * corr + pv

  _, total, acc = jax.lax.fori_loop(0, n_chunks, body, init)
  o = (acc / total).astype(cd)
  if quant is None:
    outs[0][...] = o
    return
  q_ref, st_ref = outs
  q, s = _qk.quantize_groups(o.astype(f32)[None, :], quant, interpret)  # the head: one group
  q_ref[...] = q[0]
  st_ref[...] = s.reshape(1, 1)


def fuses_layer(layer, config) -> bool:
  """Whether a decode step's layer runs its attention block in `decode_step_attention`: a
  rollout's fused q / k / v projection (`rollout_weights`) and no q / k norm (which would
  sit between the projection and RoPE)."""
  return "wqkv" in layer and not config.qk_norm


def qkv_bias(layer):
  """The (bq, bk, bv) triple `decode_step_attention` takes, or None for a layer without."""
  return (layer["bq"], layer["bk"], layer["bv"]) if "bq" in layer else None


def decode_step_attention(
  y: jax.Array,
  bias,
  cos: jax.Array,
  sin: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  mask: jax.Array,
  index: jax.Array,
  n_slots: int,
  cd,
  *,
  n_heads: int,
  quant=None,
  interpret: bool = False,
):
  """A decode step's attention block between its two projections, in one kernel: the fused
  q / k / v projection's bias and RoPE, the new key and value written into the cache at
  `index`, and attention over the first n_slots slots (as `decode_attention`).

  y [B, 1, (H + 2 Hkv) * Dh]: the fused projection's output, before its bias; bias None or
  the triple (bq [H * Dh], bk [Hkv * Dh], bv [Hkv * Dh]); cos, sin [B, 1, Dh] (`layers.rope_tables`); k_cache, v_cache [B, Hkv,
  S, Dh]; mask [B, S]: the slots the query may see, the new token's own (at index) included
  (int32 0 / 1 or bool; a decode step passes its int32 form once for all layers); index:
  int32, the new token's slot (< n_slots), a scalar or of shape [1].
  Returns (out, k_cache, v_cache), the caches updated in place (aliased). out is [B, 1, H *
  Dh] in cd or, with quant (an FP8 dtype, head size 128: a head's output is one 1 x 128
  group), the pair (q [B, H * Dh], s_t [H, B]) of `quantize(out, (1, 128))` with its scales
  transposed (the layout cuBLASLt reads), the same values as quantizing out.
  """
  b = y.shape[0]
  hkv, s, dh = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
  h = n_heads
  if y.shape != (b, 1, (h + 2 * hkv) * dh) or not supported(n_slots, dh) or n_slots > s:
    raise ValueError(
      f"decode_step_attention: y [B, 1, (H + 2 Hkv) * Dh], n_slots a multiple of {CHUNK} up "
      f"to the cache's {s} slots, a power-of-two head size; got y {y.shape}, n_slots {n_slots}"
    )
  if quant is not None and dh != 128:
    raise ValueError(f"decode_step_attention: quant needs a head size of 128, got {dh}")
  g = h // hkv
  y3 = y.reshape(b, h + 2 * hkv, dh)
  head = lambda off, per: pl.BlockSpec((None, None, dh), lambda i, j: (i, off + j // per, 0))
  specs = [head(0, 1), head(h, g), head(h + hkv, g)]
  args = [y3, y3, y3]
  if bias is not None:
    bspec = lambda per: pl.BlockSpec((None, dh), lambda i, j: (j // per, 0))
    specs += [bspec(1), bspec(g), bspec(g)]
    args += [a.reshape(-1, dh) for a in bias]
  cache_spec = pl.BlockSpec((None, None, s, dh), lambda i, j: (i, j // g, 0, 0))
  row = pl.BlockSpec((None, dh), lambda i, j: (i, 0))
  specs += [
    row,
    row,
    pl.BlockSpec((1,), lambda i, j: (0,)),
    pl.BlockSpec((None, s), lambda i, j: (i, 0)),
    cache_spec,
    cache_spec,
  ]
  args += [
    cos.reshape(b, dh),
    sin.reshape(b, dh),
    index if index.shape == (1,) else jnp.asarray(index, jnp.int32).reshape(1),
    mask if mask.dtype == jnp.int32 else mask.astype(jnp.int32),
    k_cache,
    v_cache,
  ]
  if quant is None:
    out_shape = [jax.ShapeDtypeStruct((b, h, dh), cd)]
    out_specs = [pl.BlockSpec((None, None, dh), lambda i, j: (i, j, 0))]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, h, dh), quant), jax.ShapeDtypeStruct((h, b), jnp.float32)]
    out_specs = [
      pl.BlockSpec((None, None, dh), lambda i, j: (i, j, 0)),
      pl.BlockSpec((1, 1), lambda i, j: (j, i)),
    ]
  out_shape += [
    jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
    jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
  ]
  out_specs += [cache_spec, cache_spec]
  n_in = len(args)
  outs = pl.pallas_call(
    functools.partial(
      _step_kernel,
      g=g,
      n_chunks=n_slots // CHUNK,
      scale=float(dh**-0.5),
      cd=cd,
      bias=bias is not None,
      quant=quant,
      interpret=interpret,
    ),
    out_shape=tuple(out_shape),
    grid=(b, h),
    in_specs=specs,
    out_specs=tuple(out_specs),
    input_output_aliases={n_in - 2: len(out_shape) - 2, n_in - 1: len(out_shape) - 1},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name=f"decode_step_attention_{n_slots}slots",  # read by jetrl.aot.kernels
  )(*args)
  kc, vc = outs[-2], outs[-1]
  if quant is None:
    return outs[0].reshape(b, 1, h * dh), kc, vc
  return (outs[0].reshape(b, h * dh), outs[1]), kc, vc
