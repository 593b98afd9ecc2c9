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
  - the remaining steps are elementwise arithmetic (+, *, /, rsqrt, casts, silu in the MLP),
    which XLA computes alike for every element whatever the array's shape. Most products are
    exact (float32 factors in float64, powers of two), so a fused multiply-add cannot change
    them; the others (exp64 / log64's polynomials) sit inside one elementwise expression
    that every program compiles alike, in float64 before a final rounding.
A token's log-prob therefore depends on its own row's real tokens and positions alone. Grid
rounding touches only entries far below their vector's largest (below 2^-15 of it for the
keys and queries of 64-wide heads, 2^-13 for value rows; see docs/numerics.md).

Each op is a `jax.custom_vjp` whose backward is the VJP of the standard (jet) op: exactness
is about the forward values; gradients are those of jet's numerics.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jetrl.precision.exact import F64, dot_bits, exact_sum, pow2, to_grid, x64

# At most MAX_KEYS key slots; PV_BITS: grid bits of the probabilities (times 2^e of the value
# row; per level, two levels) and of the value rows, so that MAX_KEYS-term dots are exact.
MAX_KEYS = 1 << 16
PV_BITS = (16, 21)
assert sum(PV_BITS) + 16 <= 53
MASK_VALUE = -1e30

_LN2_HI = 6.93147180369123816490e-01   # 31 significant bits: k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_SQRT2 = 1.41421356237309514547e+00


def with_reference_vjp(exact_fn, reference_fn, *args):
  """exact_fn(*args), differentiated as reference_fn (the standard op of the same math)."""

  @jax.custom_vjp
  def f(*a):
    return exact_fn(*a)

  def fwd(*a):
    return exact_fn(*a), a

  def bwd(a, ct):
    return jax.vjp(reference_fn, *a)[1](ct)

  f.defvjp(fwd, bwd)
  return f(*args)


def exp64(x: jax.Array) -> jax.Array:
  """e^x for float64 x from +, *, round and exponent bits only (relative error ~1e-16).

  x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to degree 13, times 2^k.
  Below -700 the result is 0 (it is 0 in float32 anyway); above 709, Inf; NaN stays NaN.
  """
  with x64():
    x = x.astype(F64)
    xc = jnp.clip(x, -700.0, 709.0)
    k = jnp.round(xc * _INV_LN2)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = jnp.full_like(r, 1.0 / math.factorial(13))
    for i in range(12, -1, -1):
      p = p * r + 1.0 / math.factorial(i)
    y = p * pow2(k.astype(jnp.int64))
    y = jnp.where(x < -700.0, 0.0, jnp.where(x > 709.0, jnp.inf, y))
    return jnp.where(jnp.isnan(x), x, y)


def log64(y: jax.Array) -> jax.Array:
  """log(y) for float64 y > 0 from +, *, / and exponent bits only (relative error ~1e-16).

  y = 2^e m with m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(z), z = (m - 1) / (m + 1),
  |z| <= 0.172, by its series to z^23. log(0) = -Inf, log(y < 0) = NaN, log(Inf) = Inf.
  (XLA's CPU backend flushes subnormal inputs to 0; elsewhere they are scaled up first.)
  """
  with x64():
    y = y.astype(F64)
    tiny = y < 2.0 ** -1000  # subnormal range: scale up first (exact)
    ys = jnp.where(tiny, y * 2.0 ** 60, y)
    bits = jax.lax.bitcast_convert_type(ys, jnp.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = jax.lax.bitcast_convert_type((bits & ((1 << 52) - 1)) | (1023 << 52), F64)  # [1, 2)
    big = m > _SQRT2
    m = jnp.where(big, m * 0.5, m)
    e = (e + big.astype(jnp.int64) - jnp.where(tiny, 60, 0)).astype(F64)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    s = jnp.full_like(z, 1.0 / 23.0)
    for j in range(21, 0, -2):
      s = s * z2 + 1.0 / j
    out = e * _LN2_HI + (e * _LN2_LO + 2.0 * z * s)
    out = jnp.where(y == 0, -jnp.inf, out)
    out = jnp.where(y == jnp.inf, jnp.inf, out)
    return jnp.where((y < 0) | jnp.isnan(y), jnp.nan, out)


# ---------------------------------------------------------------------------------- RMSNorm

def rms_norm(x: jax.Array, weight: jax.Array, eps: float, cd, reference) -> jax.Array:
  """x / rms(x) * weight, as `layers.rms_norm` (`reference`), with an exact sum of squares."""

  def exact(x, weight):
    with x64():
      xx = x.astype(F64)
      # Squares of bf16 / float32 values are exact in float64; their sum too (exact_sum).
      var = (exact_sum(xx * xx, -1) / x.shape[-1]).astype(jnp.float32)[..., None]
    y = (x.astype(jnp.float32) * jax.lax.rsqrt(var + eps)).astype(cd)
    return y * weight.astype(cd)

  return with_reference_vjp(exact, lambda a, w: reference(a, w, eps, cd), x, weight)


# -------------------------------------------------------------------------------- attention

def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, cd,
           reference) -> jax.Array:
  """Masked GQA attention with the shapes and meaning of `attention.attend` (`reference`).

  q [B, T, H, Dh]; k, v [B, Hkv, S, Dh]; allowed [B, T, S]. Returns [B, T, H * Dh] in cd.
  """
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  chex.assert_shape([k, v], (b, hkv, s, dh))
  chex.assert_shape(allowed, (b, t, s))
  return with_reference_vjp(lambda *a: _attend(*a, cd=cd),
                            lambda *a: reference(*a, cd), q, k, v, allowed)


def _dot64(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """float64 einsum of integer-valued operands whose sums are exact (any order, one value)."""
  return jnp.einsum(spec, a.astype(F64), b.astype(F64), preferred_element_type=F64)


def _attend(q, k, v, allowed, *, cd):
  b, t, h, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  g = h // hkv
  if s > MAX_KEYS:
    raise ValueError(f"exact attention: {s} key slots; at most {MAX_KEYS} are summed exactly")
  small = g * t <= 8  # a decode step
  qg = jnp.transpose(q.reshape(b, t, hkv, g, dh), (0, 2, 3, 1, 4))  # [B, Hkv, G, T, Dh]
  qk_bits = dot_bits(dh)
  scale = np.float64(np.float32(dh ** -0.5))
  with x64():
    # Scores: exact float64 dots of grid integers, scaled back by powers of two (exact).
    nq, eq = to_grid(qg.astype(cd), -1, qk_bits[0])          # eq [B, Hkv, G, T, 1]
    nk, ek = to_grid(k.astype(cd), -1, qk_bits[1])           # ek [B, Hkv, S, 1]
    if small:  # XLA:CPU's batched float64 dots are slow for a few query rows: multiply-sum
      dots = jnp.sum(nq.astype(F64)[:, :, :, :, None] * nk.astype(F64)[:, :, None, None], -1)
    else:
      dots = _dot64("bkgtd,bksd->bkgts", nq, nk)
    scores = dots * pow2(eq - sum(qk_bits)) * pow2(jnp.swapaxes(ek, -1, -2))[:, :, None]
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    top = jnp.max(scores, axis=-1, keepdims=True)            # order-free
    e = exp64((scores - top) * scale)
    # Probabilities in cd, as jet's. The denominator's one-level exact sum is within 2^-22.
    probs = (e / exact_sum(e, -1, levels=1, max_terms=MAX_KEYS)[..., None]).astype(cd)
    # PV: each value row v_s on its own grid (nv_s 2^(f_s - bits)); its factor 2^f_s moves
    # into the probabilities, which then share one grid per query, in two levels (hi, lo).
    nv, fv = to_grid(v.astype(cd), -1, PV_BITS[1])           # fv [B, Hkv, S, 1]
    pf = probs.astype(F64) * pow2(jnp.swapaxes(fv, -1, -2))[:, :, None]  # [B, Hkv, G, T, S]
    hi, ep = to_grid(pf, -1, PV_BITS[0])                     # ep [B, Hkv, G, T, 1]
    lo = jnp.round((pf - hi * pow2(ep - PV_BITS[0])) * pow2(2 * PV_BITS[0] - ep))
    out = (_dot64("bkgts,bksd->bkgtd", hi, nv) * pow2(ep - sum(PV_BITS))
           + _dot64("bkgts,bksd->bkgtd", lo, nv) * pow2(ep - sum(PV_BITS) - PV_BITS[0]))
    out = out.astype(cd)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h * dh)


# -------------------------------------------------------------------- LM head and log-softmax

def _logits(h: jax.Array, w: jax.Array, tied: bool, cd) -> jax.Array:
  """float32 logits [..., V] = h [..., D] @ w ([D, V], or [V, D] when tied), exact dots."""
  bits = dot_bits(h.shape[-1])
  with x64():
    nh, eh = to_grid(h.astype(cd), -1, bits[0])                # eh [..., 1]
    nw, ew = to_grid(w.astype(cd), 1 if tied else 0, bits[1])  # per vocabulary entry
    if tied:
      dots = _dot64("...d,vd->...v", nh, nw)
      ew = ew[:, 0]
    else:
      dots = _dot64("...d,dv->...v", nh, nw)
      ew = ew[0]
    return (dots * pow2(eh + ew - sum(bits))).astype(jnp.float32)


def lm_head(h: jax.Array, w: jax.Array, tied: bool, cd, reference) -> jax.Array:
  """float32 logits of `layers.lm_head` (`reference(h, w)`) with exact dots."""
  return with_reference_vjp(lambda a, b: _logits(a, b, tied, cd), reference, h, w)


def inverse_temperature(temperature) -> jax.Array:
  """float32(1 / T): the sampler and the training forward scale logits by the same factor."""
  return jnp.float32(1.0) / jnp.asarray(temperature, jnp.float32)


def log_softmax_stats(z: jax.Array, targets: jax.Array, inv_t: jax.Array):
  """(log p(target), entropy) of softmax(z * inv_t) over the last axis, float32.

  u = (z - max z) * inv_t is exact in float64 (float32 factors); the denominator is an
  exact sum of exp64(u); log p = u[target] - log64(sum).
  """
  top = jnp.max(z, axis=-1, keepdims=True)
  with x64():
    u = (z.astype(F64) - top.astype(F64)) * jnp.asarray(inv_t, jnp.float32).astype(F64)
    e = exp64(u)
    total = exact_sum(e, -1)
    lse = log64(total)
    u_t = jnp.take_along_axis(u, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = (u_t - lse).astype(jnp.float32)
    ent = (lse - exact_sum(e * u, -1) / total).astype(jnp.float32)
  return logp, ent


def chunk_stats(h: jax.Array, targets: jax.Array, w: jax.Array, temperature, tied: bool, cd,
                reference):
  """(log p(target), entropy) [B, C] from hidden states h [B, C, D] (`logprobs._chunk_stats`).

  reference(h, targets, w, temperature) is the standard computation, used for the VJP.
  """
  def exact(h, targets, w, temperature):
    return log_softmax_stats(_logits(h, w, tied, cd), targets, inverse_temperature(temperature))
  return with_reference_vjp(exact, reference, h, targets, w,
                            jnp.asarray(temperature, jnp.float32))


def token_logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature) -> jax.Array:
  """The sampler's recorded log p(token) [R] from float32 logits [R, V] (temperature 0: 1)."""
  logp, _ = log_softmax_stats(logits, tokens, inverse_temperature(temperature or 1.0))
  return logp


__all__ = ["exp64", "log64", "rms_norm", "attend", "lm_head", "chunk_stats",
           "log_softmax_stats", "token_logprobs_from_logits", "inverse_temperature"]
