"""The elementwise pieces of the batch-invariant forward (`jetrl.kernels.exact_ops`): exp and log
in float64 arithmetic, a correctly rounded float32 rsqrt, and the custom VJP that
differentiates an exact op as its standard counterpart.

Why: XLA's exp, log and rsqrt round differently in vectorised and scalar code, in its own
kernels and in YNNPACK's, i.e. depending on the array's shape and the fusion
(docs/numerics.md). These are written out in +, *, / and exponent bits, so every element gets
the same bits whatever array it sits in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.precision.exact import F64, pow2, x64

_LN2_HI = 6.93147180369123816490e-01  # 31 significant bits: k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_SQRT2 = 1.41421356237309514547e00


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
    tiny = y < 2.0**-1000  # subnormal range: scale up first (exact)
    ys = jnp.where(tiny, y * 2.0**60, y)
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


def rsqrt32(v: jax.Array) -> jax.Array:
  """float32 1 / sqrt(v), correctly rounded (nearest), for float32 v; the same bits whatever
  the array's shape, the fusion or the kernel library that computes it.

  XLA's rsqrt is an approximation whose last bit depends on where it runs: XLA:CPU hands a
  fusion with at least 4096 elements in an operand (the reduction of an RMS statistic over a
  large batch, say) to YNNPACK, whose rsqrt differs from XLA's own in about a third of the values
  (docs/numerics.md). Here an estimate n0 of n = round(2^24 / sqrt(v')) is corrected with
  exact integer arithmetic, so the result does not depend on how the estimate was computed:
  v = v' 4^k with v' in [1, 4), 1 / sqrt(v') in (1/2, 1] on float32's grid of 2^-24 there,
  and n0 + 1 (n0 - 1) when the midpoint above (below) squared times v' is below (above) 1,
  i.e. M^2 V against 2^73 with M = 2 n0 +- 1 and V = v' 2^23, both integers (no ties: M is
  odd). v <= 0, subnormal, Inf or NaN: XLA's rsqrt (0, Inf and NaN are exact there).
  """
  with x64():
    v64 = v.astype(jnp.float32).astype(F64)
    bits = jax.lax.bitcast_convert_type(v64, jnp.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    k = e >> 1  # floor(e / 2)
    vp = v64 * pow2(-2 * k)  # [1, 4), exact
    big_v = (vp * 2.0**23).astype(jnp.int64)  # exact: 24 significant bits
    est = (1.0 / jnp.sqrt(vp)) * 2.0**24  # any estimate within one step
    n0 = jnp.round(est).astype(jnp.int64)

    def below(m):  # m^2 V < 2^73 for odd integers m < 2^26, exactly in int64
      m2 = m * m
      hv = (m2 >> 26) * big_v  # < 2^51
      lv = (m2 & ((1 << 26) - 1)) * big_v  # < 2^51
      a = jnp.clip(hv - (1 << 47), -(1 << 26), 1 << 26)
      return a * (1 << 26) + lv < 0

    n = n0 + below(2 * n0 + 1).astype(jnp.int64) - (~below(2 * n0 - 1)).astype(jnp.int64)
    r = (n.astype(F64) * 2.0**-24 * pow2(-k)).astype(jnp.float32)
  normal = (v > 0) & (v < jnp.inf) & (v >= np.finfo(np.float32).tiny)
  return jnp.where(normal, r, jax.lax.rsqrt(v.astype(jnp.float32)))
