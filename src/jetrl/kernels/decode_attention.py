"""A decode step's attention in one Pallas kernel (a GPU's; interpret mode on the CPU).

One query a row attends to the first `n_slots` slots of a row's KV cache: one program per
(row, kv head) reads that kv head's keys and values once, in chunks of CHUNK slots, and
attends with each of the kv head's G query heads in turn, each with its own online float32
softmax (scores q.k of compute-dtype values summed in float32, unnormalised probabilities
rounded to the compute dtype before the p.v sum, as `attention.attend` rounds its
probabilities), and writes the G heads' [Dh] outputs. (A program per query head read the
cache G times: 42 us a layer at 64 rows and 512 slots on an H200, the largest item of a
decode step, docs/device/2026-12-04-h200-1.) XLA's form of the same step
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

Under an FP8 KV cache (`decode_attention(..., scales=...)`, head size up to 128: one 1 x 128
group a head) the kernel reads the E4M3 keys and values and their float32 scales, one a slot,
and takes each slot's key and value as `kv_cache.dequantize_kv` gives them (the FP8 value
times its scale in float32, rounded to the compute dtype): half the bytes of a bf16 cache,
the same attention of the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetrl.kernels import quant_kernel as _qk

CHUNK = 64  # slots a step of the kernel's loop reads
MASK_VALUE = -1e30  # as attention.MASK_VALUE


def supported(n_slots: int, head_dim: int) -> bool:
  """Whether the kernel takes this step: whole chunks of slots, a power-of-two head size."""
  return n_slots % CHUNK == 0 and n_slots > 0 and head_dim & (head_dim - 1) == 0


def supports_fp8(head_dim: int) -> bool:
  """Whether the kernel reads an FP8 cache of this head size: one 1 x 128 group a head."""
  return head_dim <= 128


def _attend_chunks(
  qs, k_ref, v_ref, allowed, n_chunks: int, scale: float, cd, init, ks_ref=None, vs_ref=None
):
  """The online softmax of each query head q in qs (float32 [Dh] each, or a pair of halves
  (q1, q2)) over n_chunks chunks of the kv head's keys and values, each chunk read once for
  all of them. allowed(start) -> bool [CHUNK] (the slots a query may see); init: each head's
  (running max, total, accumulator); ks_ref, vs_ref: an FP8 cache's scales [S, 1] (one group
  a slot), None for a cache in the compute dtype. Returns each head's (total, acc)."""
  f32 = jnp.float32
  r = lambda a: a.astype(cd).astype(f32)
  halves = isinstance(qs[0], tuple)
  dh = v_ref.shape[-1]
  lo, hi = pl.ds(0, dh // 2), pl.ds(dh // 2, dh // 2)

  def read(ref, s_ref, at, cols):
    """Slots `at` of a key or value ref as attention reads them (dequantized, in cd)."""
    x = ref[at, cols]
    if s_ref is None:
      return r(x)
    return r(x.astype(f32) * s_ref[at, :])  # kv_cache.dequantize_kv's arithmetic

  def body(i, carry):
    start = pl.multiple_of(i * CHUNK, CHUNK)
    at = pl.ds(start, CHUNK)
    if halves:
      k1, k2 = read(k_ref, ks_ref, at, lo), read(k_ref, ks_ref, at, hi)
    else:
      k = read(k_ref, ks_ref, at, slice(None))
    v = read(v_ref, vs_ref, at, slice(None))
    ok = allowed(start)
    out = []
    for q, (m, total, acc) in zip(qs, carry):
      if halves:
        s = jnp.sum(k1 * q[0][None, :], axis=1) + jnp.sum(k2 * q[1][None, :], axis=1)
      else:
        s = jnp.sum(k * q[None, :], axis=1)
      s = jnp.where(ok, s * f32(scale), f32(MASK_VALUE))
      m_new = jnp.maximum(m, jnp.max(s))
      corr = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new)
      pv = jnp.sum(r(p)[:, None] * v, axis=0)
      out.append((m_new, total * corr + jnp.sum(p), acc * corr + pv))
    return tuple(out)

  final = jax.lax.fori_loop(0, n_chunks, body, tuple(init))
  return [(total, acc) for _, total, acc in final]


def _kernel(*refs, g: int, n_chunks: int, scale: float, cd, fp8: bool):
  q_ref, k_ref, v_ref, m_ref = refs[:4]
  ks_ref, vs_ref = refs[4:6] if fp8 else (None, None)
  o_ref = refs[-1]
  f32 = jnp.float32
  dh = q_ref.shape[-1]
  qs = [q_ref[j].astype(cd).astype(f32) for j in range(g)]  # the group's heads, [Dh] each
  init = [(f32(MASK_VALUE), f32(0.0), jnp.zeros((dh,), f32))] * g
  allowed = lambda start: m_ref[pl.ds(start, CHUNK)] != 0
  for j, (total, acc) in enumerate(
    _attend_chunks(qs, k_ref, v_ref, allowed, n_chunks, scale, cd, init, ks_ref, vs_ref)
  ):
    o_ref[j] = (acc / total).astype(o_ref.dtype)


def decode_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  n_slots: int,
  cd,
  *,
  scales=None,
  interpret: bool = False,
) -> jax.Array:
  """q [B, 1, H, Dh]; k, v [B, Hkv, S, Dh] (the whole cache); mask [B, S] (the slots the
  query may see; only the first n_slots are read). Returns [B, 1, H * Dh] in cd.
  scales: an FP8 cache's (k_scale, v_scale) [B, Hkv, S, 1] (k and v in E4M3, Dh <= 128), or
  None for k and v in the compute dtype."""
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  if t != 1 or not supported(n_slots, dh) or n_slots > s:
    raise ValueError(
      f"decode_attention: one query a row, n_slots a multiple of {CHUNK} up to the cache's "
      f"{s} slots and a power-of-two head size; got q {q.shape}, n_slots {n_slots}"
    )
  if scales is not None and not (
    supports_fp8(dh) and all(a.shape == (b, hkv, s, 1) for a in scales)
  ):
    raise ValueError(
      f"decode_attention: an FP8 cache needs a head size up to 128 and scales [B, Hkv, S, 1] "
      f"{(b, hkv, s, 1)}; got Dh {dh}, scales {[tuple(a.shape) for a in scales]}"
    )
  g = h // hkv
  group = pl.BlockSpec((None, g, dh), lambda i, j: (i, j, 0))  # kv head j's query heads
  cache_spec = pl.BlockSpec((None, None, s, dh), lambda i, j: (i, j, 0, 0))
  in_specs = [group, cache_spec, cache_spec, pl.BlockSpec((None, s), lambda i, j: (i, 0))]
  args = [q.reshape(b, h, dh), k, v, mask.astype(jnp.int32)]
  if scales is not None:  # one scale a slot (read, as k and v, for the first n_slots only)
    in_specs += [pl.BlockSpec((None, None, s, 1), lambda i, j: (i, j, 0, 0))] * 2
    args += list(scales)
  out = pl.pallas_call(
    functools.partial(
      _kernel,
      g=g,
      n_chunks=n_slots // CHUNK,
      scale=float(dh**-0.5),
      cd=cd,
      fp8=scales is not None,
    ),
    out_shape=jax.ShapeDtypeStruct((b, h, dh), cd),
    grid=(b, hkv),
    in_specs=in_specs,
    out_specs=group,
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name=f"decode_attention_{n_slots}slots",  # read by jetrl.aot.kernels
  )(*args)
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
  dh = yk_ref.shape[-1]
  half = dh // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  r = lambda a: a.astype(cd).astype(f32)

  def head(y_ref, b_ref, *at):
    """A head's part (at: [j,] columns) of the projection, with its bias, as float32."""
    x = y_ref[at].astype(f32)
    return x if b_ref is None else r(x + b_ref[at].astype(f32))  # y + bias, in cd

  c1, c2 = cos_ref[lo].astype(f32), cos_ref[hi].astype(f32)
  s1, s2 = sin_ref[lo].astype(f32), sin_ref[hi].astype(f32)
  k1, k2 = _rope_halves(head(yk_ref, bk_ref, lo), head(yk_ref, bk_ref, hi), c1, c2, s1, s2, cd)
  v_new = head(yv_ref, bv_ref, pl.ds(0, dh))
  idx = idx_ref[0]

  # The new token's key and value go into slot idx of the kv head, written once; every query
  # head of the group takes them from registers, not the cache.
  row = pl.ds(idx, 1)
  ko_ref[row, lo] = k1[None, :].astype(ko_ref.dtype)
  ko_ref[row, hi] = k2[None, :].astype(ko_ref.dtype)
  vo_ref[row, :] = v_new[None, :].astype(vo_ref.dtype)

  qs, init = [], []
  new_ok = m_ref[idx] != 0
  for j in range(g):
    q1, q2 = _rope_halves(
      head(yq_ref, bq_ref, j, lo), head(yq_ref, bq_ref, j, hi), c1, c2, s1, s2, cd
    )
    qs.append((q1, q2))
    # The new slot first (an online softmax's first term), masked as its own mask says.
    s_new = (jnp.sum(q1 * r(k1)) + jnp.sum(q2 * r(k2))) * f32(scale)
    init.append((jnp.where(new_ok, s_new, f32(MASK_VALUE)), f32(1.0), r(v_new)))

  def allowed(start):
    slots = start + jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    return (m_ref[pl.ds(start, CHUNK)] != 0) & (slots != idx)

  results = _attend_chunks(qs, k_ref, v_ref, allowed, n_chunks, scale, cd, init)
  for j, (total, acc) in enumerate(results):
    o = (acc / total).astype(cd)
    if quant is None:
      outs[0][j] = o
      continue
    q_ref, st_ref = outs
    q, s = _qk.quantize_groups(o.astype(f32)[None, :], quant, interpret)  # the head: one group
    q_ref[j] = q[0]
    st_ref[pl.ds(j, 1), :] = s.reshape(1, 1)


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
  # Program (row i, kv head j): its G query heads, then its key and value heads (after the H
  # query heads and the Hkv key heads); the biases likewise.
  y3 = y.reshape(b, h + 2 * hkv, dh)
  specs = [
    pl.BlockSpec((None, g, dh), lambda i, j: (i, j, 0)),
    pl.BlockSpec((None, None, dh), lambda i, j: (i, h + j, 0)),
    pl.BlockSpec((None, None, dh), lambda i, j: (i, h + hkv + j, 0)),
  ]
  args = [y3, y3, y3]
  if bias is not None:
    specs += [
      pl.BlockSpec((g, dh), lambda i, j: (j, 0)),
      pl.BlockSpec((None, dh), lambda i, j: (j, 0)),
      pl.BlockSpec((None, dh), lambda i, j: (j, 0)),
    ]
    args += [a.reshape(-1, dh) for a in bias]
  cache_spec = pl.BlockSpec((None, None, s, dh), lambda i, j: (i, j, 0, 0))
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
  group = pl.BlockSpec((None, g, dh), lambda i, j: (i, j, 0))
  if quant is None:
    out_shape = [jax.ShapeDtypeStruct((b, h, dh), cd)]
    out_specs = [group]
  else:
    out_shape = [jax.ShapeDtypeStruct((b, h, dh), quant), jax.ShapeDtypeStruct((h, b), jnp.float32)]
    out_specs = [group, pl.BlockSpec((g, 1), lambda i, j: (j, i))]
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
    grid=(b, hkv),
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
