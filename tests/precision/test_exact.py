"""The batch-invariant arithmetic of `jet_exact`: the FP8 GEMM against a float64 numpy
reference of its blockwise formula, batch invariance bit for bit, exact fixed-point sums,
float64 exp / log, a correctly rounded rsqrt, and the recipe's definition."""

import dataclasses
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_reference import ref_exact_gemm, to_bf16
from jetrl.models import layers
from jetrl.kernels.exact_ops import exp64, log64, rms_norm, rsqrt32
from jetrl.kernels import linear
from jetrl.precision import RECIPES, Fp8Gemm, Precision, get_recipe, quantize_weight
from jetrl.kernels import Device, cpu_kernels
from jetrl.kernels.exact_gemm import fp8_fprop
from jetrl.precision.exact import exact_sum, x64

EXACT = get_recipe("jet_exact")
G = EXACT.train.fprop
M, K, N = 130, 300, 200  # partial token groups, partial K and N blocks


@pytest.fixture(scope="module")
def xw():
  rng = np.random.default_rng(0)
  # Rows of very different magnitudes, a zero row, and weights with small and large blocks.
  x = rng.standard_normal((M, K)).astype(np.float32) * np.exp(2 * rng.standard_normal((M, 1)))
  x[3] = 0.0
  x[5, :128] *= 1e-6
  w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
  w[128:256, :128] *= 1e4
  return to_bf16(x), w


_KERNEL = cpu_kernels.usable(Device("cpu"))  # the CPU kernels where this process can run them
_fprop = jax.jit(lambda x, w: fp8_fprop(x, *quantize_weight(w, G)[:2], G, kernel=_KERNEL))


def test_exact_gemm_equals_the_float64_blockwise_reference(xw):
  x, w = xw
  y = np.asarray(_fprop(jnp.asarray(x, jnp.bfloat16), w))
  ref = ref_exact_gemm(x, w)
  assert y.dtype == np.float32
  np.testing.assert_array_equal(y.view(np.uint32), ref.view(np.uint32))
  # linear() under the recipe: the same values rounded to bf16, in training and in rollout.
  want = ref.astype(ml_dtypes.bfloat16).view(np.uint16)
  for prec in (EXACT.train, EXACT.rollout):
    got = np.asarray(jax.jit(lambda a, b: linear(a, b, prec))(x, w))
    np.testing.assert_array_equal(got.view(np.uint16), want)


def test_exact_gemm_is_batch_invariant(xw):
  x, w = xw
  rng = np.random.default_rng(1)
  many = to_bf16(rng.standard_normal((257, K)).astype(np.float32))
  many[100] = x[7]
  alone = np.asarray(_fprop(jnp.asarray(x[7:8], jnp.bfloat16), w))
  inside = np.asarray(_fprop(jnp.asarray(many, jnp.bfloat16), w))[100:101]
  np.testing.assert_array_equal(alone.view(np.uint32), inside.view(np.uint32))
  np.testing.assert_array_equal(alone.view(np.uint32), ref_exact_gemm(x[7:8], w).view(np.uint32))


@pytest.mark.parametrize("tile_bytes", [4096, 70000])
def test_exact_gemm_in_row_tiles_equals_the_reference(xw, monkeypatch, tile_bytes):
  # Large outputs go in row tiles (strided rows, zero-padded when no divisor fits): small
  # tiles forced here, on 130 rows and on 131 (prime: padded), must not change a bit.
  from jetrl.precision import exact

  x, w = xw
  monkeypatch.setattr(exact, "TILE_BYTES", tile_bytes)
  for rows in (x, np.concatenate([x, x[7:8]])):
    assert exact._row_tiles(rows.shape[0], N) >= 2
    # The XLA path (the CPU kernel computes whole outputs at once, without tiles).
    f = jax.jit(lambda a, b: fp8_fprop(a, *quantize_weight(b, G)[:2], G, kernel=False))
    y = np.asarray(f(jnp.asarray(rows, jnp.bfloat16), w))
    np.testing.assert_array_equal(y.view(np.uint32), ref_exact_gemm(rows, w).view(np.uint32))


def test_exact_sum_does_not_depend_on_the_order():
  rng = np.random.default_rng(2)
  terms = rng.standard_normal((4, 1000)) * np.exp(rng.uniform(-30, 30, (4, 1000)))
  perms = [np.arange(1000)] + [rng.permutation(1000) for _ in range(3)]
  f = jax.jit(exact_sum)
  with x64():
    sums = [np.asarray(f(jnp.asarray(terms[:, p]))) for p in perms]
    rows = [float(f(jnp.asarray(terms[i : i + 1, ::-1]))[0]) for i in range(4)]
  for s in sums[1:]:
    np.testing.assert_array_equal(s, sums[0])
  np.testing.assert_array_equal(np.asarray(rows), sums[0])  # one row alone, reversed
  for i in range(4):
    ref = math.fsum(terms[i])
    assert abs(sums[0][i] - ref) <= 2.0**-40 * np.abs(terms[i]).max(), (sums[0][i], ref)


def test_exp64_and_log64_match_float64_references():
  rng = np.random.default_rng(3)
  x = np.concatenate(
    [rng.uniform(-50, 0, 3000), rng.uniform(-700, 700, 1000), [0.0, -1e-300, 1e-12, -745.0]]
  )
  y = np.concatenate([np.exp(rng.uniform(-700, 700, 3000)), [1.0, 2.0, 0.5, 2.3e-308]])
  with x64():
    e = np.asarray(jax.jit(exp64)(jnp.asarray(x)))
    lg = np.asarray(jax.jit(log64)(jnp.asarray(y)))
    special = np.asarray(jax.jit(log64)(jnp.asarray([0.0, -1.0, np.inf, np.nan])))
  ok = x > -700
  np.testing.assert_allclose(e[ok], np.exp(x[ok]), rtol=4e-16, atol=0)
  assert (e[~ok] == 0).all() and e[x == 0.0] == 1.0
  np.testing.assert_allclose(lg, np.log(y), rtol=4e-16, atol=1e-300)
  assert special[0] == -np.inf and np.isnan(special[1]) and special[2] == np.inf
  assert np.isnan(special[3])
  with x64():  # the same values whatever the array's shape (vector or scalar code paths)
    for n in (1, 3, 7, 17):
      np.testing.assert_array_equal(np.asarray(jax.jit(exp64)(jnp.asarray(x[:n]))), e[:n])


def _rounded_to_nearest(v, r):
  """Whether float32 r is 1 / sqrt(v) rounded to nearest: the midpoints to its float32
  neighbours, squared times v, lie on either side of 1 (exactly, in rationals)."""
  v, mid = Fraction(float(v)), Fraction(float(r))
  lo = (mid + Fraction(float(np.nextafter(r, np.float32(0))))) / 2
  hi = (mid + Fraction(float(np.nextafter(r, np.float32(np.inf))))) / 2
  return lo * lo * v < 1 < hi * hi * v


def test_rsqrt32_is_correctly_rounded_in_any_program():
  """XLA:CPU runs a fusion with >= 4096 elements through YNNPACK, whose rsqrt differs from
  XLA's own in the last bit: `rsqrt32` is the correctly rounded value in both, so the exact
  RMSNorm of a vector is the same in a batch of 4608 vectors as in a batch of 8."""
  rng = np.random.default_rng(4)
  v = np.concatenate(
    [
      (2.0 ** rng.uniform(-126, 127, 20000)),
      rng.uniform(1e-6, 4.0, 20000),
      [1.0, 2.0, 4.0, 0.25, 1e-6, 3.4028235e38, 1.1754944e-38],
    ]
  ).astype(np.float32)
  f = jax.jit(rsqrt32)
  r = np.asarray(f(v))
  assert all(_rounded_to_nearest(v[i], r[i]) for i in range(len(v))), "not correctly rounded"
  np.testing.assert_array_equal(np.concatenate([f(v[i : i + 7]) for i in range(0, 70, 7)]), r[:70])
  special = np.asarray(f(np.asarray([0.0, -1.0, np.inf, np.nan], np.float32)))
  assert special[0] == np.inf and np.isnan(special[1]) and special[2] == 0 and np.isnan(special[3])
  # Query / key norms of 72 tokens x 4 heads: 16 rows reach YNNPACK's threshold, 2 do not.
  x = jnp.asarray(
    rng.standard_normal((16, 72, 4, 64)) * np.exp(rng.uniform(-3, 3, (16, 72, 4, 1))), jnp.bfloat16
  )
  w = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float32)
  norm = jax.jit(lambda a: rms_norm(a, w, 1e-6, jnp.bfloat16, layers.rms_norm))
  big, small = np.asarray(norm(x)[:2], np.float32), np.asarray(norm(x[:2]), np.float32)
  np.testing.assert_array_equal(big, small)
  # The values: the mean square exactly (fsum), its rsqrt correctly rounded to float32, then
  # x * rsqrt in float32, bf16, times the bf16 weight, bf16 (ties of the double rounding of
  # 1 / sqrt and the sum's 2^-38 error can move a value by one bf16 step, rarely).
  xs = np.asarray(x[:2], np.float64).reshape(-1, 64)
  var = np.float32([math.fsum(r * r) / 64 for r in xs]) + np.float32(1e-6)
  inv = (1.0 / np.sqrt(var.astype(np.float64))).astype(np.float32)
  y = (xs.astype(np.float32) * inv[:, None]).astype(ml_dtypes.bfloat16)
  want = (
    (y.astype(np.float32) * np.asarray(w, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))
    .astype(ml_dtypes.bfloat16)
    .astype(np.float32)
  )
  got = big.reshape(-1, 64)
  assert np.mean(got == want) > 0.999
  np.testing.assert_allclose(got, want, rtol=2**-7, atol=0)


def test_recipe():
  assert "jet_exact" in RECIPES
  r = EXACT
  assert r.unified and r.train.batch_invariant and r.rollout.batch_invariant
  assert r.rollout.fprop is r.train.fprop and r.rollout.dgrad is None
  assert dataclasses.replace(get_recipe("jet").train, batch_invariant=True) == r.train
  assert not get_recipe("jet").train.batch_invariant
  assert get_recipe("jet_exact", grad_fmt="e5m2").train.dgrad.grad_fmt == "e5m2"
  hash(r.train), hash(r.rollout)


@pytest.mark.parametrize(
  "fprop,match",
  [
    (None, "no fprop"),
    (Fp8Gemm(scaling="tensor"), "scaling='tensor'"),
    (Fp8Gemm(fmt="e5m2"), "fmt='e5m2'"),
    (Fp8Gemm(block=256), "block=256"),
  ],
)
def test_batch_invariant_needs_an_exact_fprop(fprop, match):
  with pytest.raises(ValueError, match=match):
    Precision("bfloat16", fprop=fprop, batch_invariant=True)
