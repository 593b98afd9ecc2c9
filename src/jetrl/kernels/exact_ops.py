"""The batch-invariant forward of the `jet_exact` recipe: RMSNorm, attention, LM head and the
temperature-scaled log-softmax, each computed so that its result for one token does not
depend on anything but that token's own inputs.

Why: the sampler computes a token's log-prob in a decode step over the KV cache (a few rows,
one query, a cache of S slots), the training forward in a full-sequence program (many rows,
T queries, T keys). With XLA's dots and reductions the two sum in different orders and their
last bits differ (docs/numerics.md). Here every sum is exact (`jetrl.precision.exact`), and
an exact sum has one value whatever the order, the shapes or the device:
  - dots (QK^T, PV, the LM head): both operands are rounded to fixed-point grids set by each
    vector's own largest entry (a query, a key, a value row, a hidden state, a vocabulary
    entry's weights), so the float64 dot of the integers is exact. For PV the value row's
    power of two moves into the probabilities, which then share one grid per query (two
    levels, hi and lo); masked keys have probability exactly 0 and add exact zeros, so a
    cache longer than the sequence, or more left padding, changes nothing;
  - sums (the RMS statistic, softmax denominators over keys and over the vocabulary):
    `exact_sum`;
  - exp and log are written out in float64 arithmetic (`exp64`, `log64`): XLA's exp and log
    round differently in vectorised and scalar code, i.e. depending on the array's shape;
  - the RMS statistic's rsqrt is correctly rounded (`rsqrt32`): XLA:CPU computes a large
    fusion's rsqrt in YNNPACK, a small one's in its own code, and the two round differently;
  - the remaining steps are elementwise arithmetic (+, *, /, casts, silu in the MLP), which
    XLA (and YNNPACK) compute alike for every element whatever the array's shape. Most products are
    exact (float32 factors in float64, powers of two), so a fused multiply-add cannot change
    them; the others (exp64 / log64's polynomials) sit inside one elementwise expression
    that every program compiles alike, in float64 before a final rounding.
A token's log-prob therefore depends on its own row's real tokens and positions alone. Grid
rounding touches only entries far below their vector's largest (below 2^-15 of it for the
keys and queries of 64-wide heads, 2^-13 for value rows; see docs/numerics.md).

Each op is a `jax.custom_vjp` whose backward is the VJP of the standard (jet) op: exactness
is about the forward values; gradients are those of jet's numerics. The elementwise pieces
(`exp64`, `log64`, `rsqrt32`, `with_reference_vjp`) are in `jetrl.precision.exact_math`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import cpu_kernels as _cpu_kernels
from jetrl.precision import truncation
from jetrl.precision.exact_math import exp64, log64, rsqrt32, with_reference_vjp
from jetrl.precision.exact import F64, dot_bits, exact_sum, pow2, to_grid, x64

# At most MAX_KEYS key slots; PV_BITS: grid bits of the probabilities (times 2^e of the value
# row; per level, two levels) and of the value rows, so that MAX_KEYS-term dots are exact.
MAX_KEYS = 1 << 16
PV_BITS = (16, 21)
assert sum(PV_BITS) + 16 <= 53
MASK_VALUE = -1e30


# ---------------------------------------------------------------------------------- RMSNorm


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, cd, reference) -> jax.Array:
  """x / rms(x) * weight, as `layers.rms_norm` (`reference`), with an exact sum of squares."""

  def exact(x, weight):
    with x64():
      xx = x.astype(F64)
      # Squares of bf16 / float32 values are exact in float64; their sum is order-free
      # (exact_sum), one level: within D 2^-(54 - log2 D) of the largest square, far below
      # the float32 rounding of the mean.
      d = x.shape[-1]
      var = (exact_sum(xx * xx, -1, levels=1, max_terms=d) / d).astype(jnp.float32)[..., None]
    y = (x.astype(jnp.float32) * rsqrt32(var + eps)).astype(cd)
    return y * weight.astype(cd)

  return with_reference_vjp(exact, lambda a, w: reference(a, w, eps, cd), x, weight)


# -------------------------------------------------------------------------------- attention


def attend(
  q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, cd, reference, *, kernel=False
) -> jax.Array:
  """Masked GQA attention with the shapes and meaning of `attention.attend` (`reference`).

  q [B, T, H, Dh]; k, v [B, Hkv, S, Dh]; allowed [B, T, S]. Returns [B, T, H * Dh] in cd.
  The keys and values are put on their grids here (`grid_keys`, `grid_values`), then
  `attend_grids`.
  """
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  chex.assert_shape([k, v], (b, hkv, s, dh))
  chex.assert_shape(allowed, (b, t, s))

  def exact(q, k, v, allowed):
    return _attend_grids(q, grid_keys(k, cd), *grid_values(v, cd), allowed, cd=cd, kernel=kernel)

  return with_reference_vjp(exact, lambda *a: reference(*a, cd), q, k, v, allowed)


def grid_keys(k: jax.Array, cd) -> jax.Array:
  """Each key vector (last axis, Dh) rounded to its QK^T grid, in cd (exactly).

  The grid n 2^(e - bits) depends on the vector alone, so a KV cache can hold the rounded key
  from the step that wrote it on: `attend_grids` reads it as it is. In cd because a bf16 (or
  float32) vector's rounded entries are bf16 (float32) numbers: the entries within 2^(8 -
  bits) of the largest are on the grid already, the smaller ones become integers below 2^8
  times the grid's unit (a normal number: `to_grid` keeps it >= 2^-126).
  """
  bits = dot_bits(k.shape[-1])[1]
  n, e = to_grid(k.astype(cd), -1, bits)
  return _from_grid(n, e, bits, cd)


def grid_values(v: jax.Array, cd):
  """(value rows rounded to their PV grids, in cd; their exponents f, int32 [..., 1]).

  f (2^f bounds the row's largest entry) scales the probabilities in `attend_grids`; like the
  rounded row it depends on the row alone, so a KV cache keeps both from the step that wrote
  the row.
  """
  n, f = to_grid(v.astype(cd), -1, PV_BITS[1])
  return _from_grid(n, f, PV_BITS[1], cd), f.astype(jnp.int32)


def _from_grid(n, e, bits, cd):
  """n 2^(e - bits) in cd, exactly (see `grid_keys`)."""
  if n.dtype == jnp.float32:  # to_grid's float32 branch: the unit 2^(e - bits) is normal
    unit = jax.lax.bitcast_convert_type((e - bits + 127) << 23, jnp.float32)
    return (n * unit).astype(cd)
  with x64():
    return (n * pow2(e - bits)).astype(cd)


def attend_grids(
  q: jax.Array,
  kg: jax.Array,
  vg: jax.Array,
  fv: jax.Array,
  allowed: jax.Array,
  cd,
  reference,
  *,
  kernel: bool = False,
) -> jax.Array:
  """`attend` on keys and values already on their grids (a KV cache's: `grid_keys`,
  `grid_values`); kg, vg [B, Hkv, S, Dh], fv [B, Hkv, S, 1]. The same values as `attend` on
  the keys and values they came from. Differentiated as `reference` on kg and vg.
  """
  b, t, h, dh = q.shape
  hkv, s = kg.shape[1], kg.shape[2]
  chex.assert_shape([kg, vg], (b, hkv, s, dh))
  chex.assert_shape(fv, (b, hkv, s, 1))
  chex.assert_shape(allowed, (b, t, s))
  return with_reference_vjp(
    lambda *a: _attend_grids(*a, cd=cd, kernel=kernel),
    lambda q, k, v, f, a: reference(q, k, v, a, cd),
    q,
    kg,
    vg,
    fv,
    allowed,
  )


def _dot64(spec: str, a: jax.Array, b: jax.Array, kernel: bool) -> jax.Array:
  """float64 einsum of operands whose sums are exact (any order, one value).

  With `kernel` (the plan's device can run the CPU kernels: `cpu_kernels.usable`) the four
  contractions below run as one kernel call each (`cpu_kernels.exact_dot`: an exact sum has
  one value, so the bits are the same)."""
  if kernel and spec in _KERNEL_DOTS and _kernel_dtypes(a, b):
    return _KERNEL_DOTS[spec](a, b)
  return jnp.einsum(spec, a.astype(F64), b.astype(F64), preferred_element_type=F64)


def _kernel_dtypes(a, b) -> bool:
  return a.dtype in (jnp.float32, F64) and b.dtype in (jnp.bfloat16, jnp.float32)


def _qk_kernel(a, b):  # a [B, K, G, T, D], b [B, K, S, D] -> [B, K, G, T, S]
  bb, kk, g, t, d = a.shape
  out = _cpu_kernels.exact_dot(a.reshape(bb * kk, g * t, d), b.reshape(bb * kk, -1, d), b_nk=True)
  return out.reshape(bb, kk, g, t, -1)


def _pv_kernel(a, b):  # a [B, K, G, T, S], b [B, K, S, D] -> [B, K, G, T, D]
  bb, kk, g, t, s = a.shape
  out = _cpu_kernels.exact_dot(a.reshape(bb * kk, g * t, s), b.reshape(bb * kk, s, -1), b_nk=False)
  return out.reshape(bb, kk, g, t, -1)


def _head_kernel(b_nk: bool):  # a [..., D], b [V, D] (b_nk) or [D, V] -> [..., V]
  def f(a, b):
    out = _cpu_kernels.exact_dot(a.reshape(1, -1, a.shape[-1]), b[None], b_nk=b_nk)
    return out.reshape(*a.shape[:-1], out.shape[-1])

  return f


_KERNEL_DOTS = {
  "bkgtd,bksd->bkgts": _qk_kernel,
  "bkgts,bksd->bkgtd": _pv_kernel,
  "...d,vd->...v": _head_kernel(True),
  "...d,dv->...v": _head_kernel(False),
}


def _attend_grids(q, kg, vg, fv, allowed, *, cd, kernel: bool):
  """The exact attention from gridded keys kg, values vg and value exponents fv.

  QK^T: the query on its grid (nq 2^(eq - a)) times a gridded key (nk 2^(ek - b)): every
  product is a multiple of 2^(eq + ek - a - b) below 2^(eq + ek), and Dh of them stay within
  53 bits, so the float64 dot of the gridded values is exact: the integer dot, scaled back.
  PV: the value row's 2^f moves into the probabilities, which share one grid per query in two
  levels (hi, lo of 16 bits); hi_s 2^-f_s times the gridded row nv_s 2^(f_s - 21) is
  hi_s nv_s 2^-21, a multiple of 2^-21 below 2^16, and at most 2^16 of them stay within 53
  bits: the float64 dots of both levels are exact too. The grids are those of the integer
  formulation in docs/numerics.md, so the values are the same.
  """
  b, t, h, dh = q.shape
  hkv, s = kg.shape[1], kg.shape[2]
  g = h // hkv
  if s > MAX_KEYS:
    raise ValueError(f"exact attention: {s} key slots; at most {MAX_KEYS} are summed exactly")
  small = g * t <= 8  # a decode step
  qg = jnp.transpose(q.reshape(b, t, hkv, g, dh), (0, 2, 3, 1, 4))  # [B, Hkv, G, T, Dh]
  qbits = dot_bits(dh)[0]
  scale = np.float64(np.float32(dh**-0.5))
  qv = _from_grid(*to_grid(qg.astype(cd), -1, qbits), qbits, jnp.float32)
  with x64():
    if small and not kernel:
      # XLA:CPU's batched float64 dots are slow for a few query rows: multiply-sum
      scores = jnp.sum(qv.astype(F64)[:, :, :, :, None] * kg.astype(F64)[:, :, None, None], -1)
    else:
      scores = _dot64("bkgtd,bksd->bkgts", qv, kg, kernel)
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    top = jnp.max(scores, axis=-1, keepdims=True)  # order-free
    e = exp64((scores - top) * scale)
    # Probabilities in cd, as jet's. The denominator's one-level exact sum is within 2^-22.
    probs = (e / exact_sum(e, -1, levels=1, max_terms=MAX_KEYS)[..., None]).astype(cd)
    f = jnp.swapaxes(fv, -1, -2)[:, :, None]  # [B, Hkv, 1, 1, S]
    pf = probs.astype(F64) * pow2(f)  # [B, Hkv, G, T, S]
    hi, ep = to_grid(pf, -1, PV_BITS[0])  # ep [B, Hkv, G, T, 1]
    lo = jnp.round((pf - hi * pow2(ep - PV_BITS[0])) * pow2(2 * PV_BITS[0] - ep))
    w = jnp.concatenate([hi, lo], axis=2) * pow2(-f)  # [B, Hkv, 2G, T, S]
    pv = _dot64("bkgts,bksd->bkgtd", w, vg, kernel)
    out = pv[:, :, :g] * pow2(ep - PV_BITS[0]) + pv[:, :, g:] * pow2(ep - 2 * PV_BITS[0])
    out = out.astype(cd)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h * dh)


# -------------------------------------------------------------------- LM head and log-softmax


def grid_lm_head(w: jax.Array, tied: bool, cd) -> jax.Array:
  """The LM head's weights (w [D, V], or [V, D] when tied) with each vocabulary entry's
  weights rounded to its grid, in cd (exactly; see `grid_keys`). A rollout computes this once
  (`jetrl.models.rollout_weights`) instead of at every decode step."""
  bits = dot_bits(w.shape[1] if tied else w.shape[0])[1]
  n, e = to_grid(w.astype(cd), 1 if tied else 0, bits)
  return _from_grid(n, e, bits, cd)


def _logits(h: jax.Array, w: jax.Array, tied: bool, cd, kernel: bool) -> jax.Array:
  """float32 logits [..., V] = h [..., D] @ w ([D, V], or [V, D] when tied), exact dots."""
  return _logits_grids(h, grid_lm_head(w, tied, cd), tied, cd, kernel)


def _logits_grids(h: jax.Array, wg: jax.Array, tied: bool, cd, kernel: bool) -> jax.Array:
  """`_logits` with the weights on their grids (`grid_lm_head`). Each product of a gridded
  hidden state (unit 2^(eh - a)) and a gridded vocabulary entry (2^(ew - b)) is a multiple of
  2^(eh + ew - a - b) below 2^(eh + ew); D of them stay within 53 bits: the float64 dot of
  the gridded values is exact."""
  bits = dot_bits(h.shape[-1])[0]
  hg = _from_grid(*to_grid(h.astype(cd), -1, bits), bits, jnp.float32)
  with x64():
    spec = "...d,vd->...v" if tied else "...d,dv->...v"
    return _dot64(spec, hg, wg, kernel).astype(jnp.float32)


def lm_head(h: jax.Array, w: jax.Array, tied: bool, cd, reference, *, kernel=False) -> jax.Array:
  """float32 logits of `layers.lm_head` (`reference(h, w)`) with exact dots (kernel: in the
  CPU kernels, `_dot64`)."""
  return with_reference_vjp(lambda a, b: _logits(a, b, tied, cd, kernel), reference, h, w)


def lm_head_grids(
  h: jax.Array, wg: jax.Array, tied: bool, cd, reference, *, kernel: bool = False
) -> jax.Array:
  """`lm_head` from weights already on their grids (`grid_lm_head`): the same logits."""
  exact = lambda a, b: _logits_grids(a, b, tied, cd, kernel)
  return with_reference_vjp(exact, reference, h, wg)


def matmul(h: jax.Array, w: jax.Array, cd, reference, *, kernel: bool = False) -> jax.Array:
  """float32 h [..., K] @ w [K, N] with exact dots (`_logits`), differentiated as
  `reference(h, w)`: the LoRA adapters' GEMMs. A small K (the rank) gives grids finer than
  float32 holds, so the grids are computed in float64 too, inside the function."""

  def exact(a, b):
    with x64():
      return _logits(a, b, False, cd, kernel)

  return with_reference_vjp(exact, reference, h, w)


def softmax(z: jax.Array) -> jax.Array:
  """float32 softmax of z over the last axis from exact float64 sums (a mixture of experts'
  router, `Plan.router`): exp64(z - max z) / exact_sum, one value whatever the batch;
  differentiated as `jax.nn.softmax`."""

  def exact(a):
    with x64():
      u = a.astype(F64) - jnp.max(a, axis=-1, keepdims=True).astype(F64)
      e = exp64(u)
      return (e / exact_sum(e, -1)[..., None]).astype(jnp.float32)

  return with_reference_vjp(exact, lambda a: jax.nn.softmax(a, axis=-1), z.astype(jnp.float32))


def inverse_temperature(temperature) -> jax.Array:
  """float32(1 / T): the sampler and the training forward scale logits by the same factor."""
  return jnp.float32(1.0) / jnp.asarray(temperature, jnp.float32)


def log_softmax_stats(z: jax.Array, targets: jax.Array, inv_t: jax.Array, keep=None):
  """(log p(target), entropy) of softmax(z * inv_t) over the last axis, float32.

  u = (z - max z) * inv_t is exact in float64 (float32 factors); the denominator is an
  exact sum of exp64(u); log p = u[target] - log64(sum). keep: bool [..., V], the tokens of
  a top-k / top-p truncated distribution (`jetrl.precision.truncation`, the target counted in):
  the others' terms are 0, so the distribution is renormalised over the kept ones.
  """
  top = jnp.max(z, axis=-1, keepdims=True)
  with x64():
    u = (z.astype(F64) - top.astype(F64)) * jnp.asarray(inv_t, jnp.float32).astype(F64)
    e = exp64(u)
    if keep is not None:
      e = jnp.where(keep, e, 0.0)
    total = exact_sum(e, -1)
    lse = log64(total)
    u_t = jnp.take_along_axis(u, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = (u_t - lse).astype(jnp.float32)
    ent = (lse - exact_sum(e * u, -1) / total).astype(jnp.float32)
  return logp, ent


def truncated_keep(z: jax.Array, targets: jax.Array, inv_t: jax.Array, top_k, top_p):
  """The kept set of `log_softmax_stats` under top-k / top-p (None when nothing is cut)."""
  if not truncation.is_truncated(top_k, top_p, z.shape[-1]):
    return None
  return truncation.with_targets(truncation.keep_mask_exact(z, inv_t, top_k, top_p), targets)


def chunk_stats(
  h: jax.Array,
  targets: jax.Array,
  w: jax.Array,
  temperature,
  tied: bool,
  cd,
  reference,
  top_k=None,
  top_p: float = 1.0,
  *,
  kernel: bool = False,
):
  """(log p(target), entropy) [B, C] from hidden states h [B, C, D] (`logprobs._chunk_stats`),
  under top-k / top-p truncation when they cut (`jetrl.precision.truncation`).

  reference(h, targets, w, temperature) is the standard computation, used for the VJP.
  kernel: the head's exact dots in the CPU kernels (`_dot64`).
  """

  def exact(h, targets, w, temperature):
    z, inv_t = _logits(h, w, tied, cd, kernel), inverse_temperature(temperature)
    keep = truncated_keep(z, targets, inv_t, top_k, top_p)
    return log_softmax_stats(z, targets, inv_t, keep)

  return with_reference_vjp(exact, reference, h, targets, w, jnp.asarray(temperature, jnp.float32))


def token_logprobs_from_logits(
  logits: jax.Array, tokens: jax.Array, temperature, keep=None
) -> jax.Array:
  """The sampler's recorded log p(token) [R] from float32 logits [R, V] (temperature 0: 1),
  over the kept set `keep` [R, V] when top-k / top-p truncate."""
  logp, _ = log_softmax_stats(logits, tokens, inverse_temperature(temperature or 1.0), keep)
  return logp


__all__ = [
  "exp64",
  "log64",
  "rsqrt32",
  "rms_norm",
  "attend",
  "attend_grids",
  "grid_keys",
  "grid_values",
  "grid_lm_head",
  "lm_head",
  "lm_head_grids",
  "chunk_stats",
  "log_softmax_stats",
  "token_logprobs_from_logits",
  "inverse_temperature",
]
