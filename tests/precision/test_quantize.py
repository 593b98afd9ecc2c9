"""quantize / dequantize against the independent numpy reference (bit-exact)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fp8_reference import F8, ref_dequantize, ref_quantize
from jetrl.precision import E4M3, E5M2, dequantize, quantize

FMT_DTYPE = {"e4m3": E4M3, "e5m2": E5M2}

# One jitted quantizer per (block, fmt, pow2) so hypothesis examples reuse compiles.
_jitted = {}


def jq(x, block, fmt="e4m3", pow2=False):
  key = (block, fmt, pow2)
  if key not in _jitted:
    _jitted[key] = jax.jit(lambda a: quantize(a, block, FMT_DTYPE[fmt], pow2))
  return _jitted[key](x)


def assert_bits_equal(q, q_ref, scale, scale_ref):
  q = np.asarray(q)
  assert q.dtype == q_ref.dtype
  np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), scale_ref.view(np.uint32))


@st.composite
def arrays(draw):
  rows = draw(st.sampled_from([1, 2, 3, 130]))
  k = draw(st.sampled_from([1, 127, 128, 129, 300]))
  log_mag = draw(st.floats(-30, 30))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k)) * 10.0**log_mag
  # A heavy-tailed spread inside tiles, and some exact zeros / negative zeros.
  x *= np.exp(rng.standard_normal((rows, k)) * draw(st.sampled_from([0.0, 1.0, 4.0])))
  zmask = rng.random((rows, k)) < draw(st.sampled_from([0.0, 0.1]))
  x[zmask] = -0.0
  x = x.astype(np.float32)
  # a tile whose scale would be a float32 subnormal is outside the contract (docs/numerics.md:
  # XLA's CPU flushes it); no value below E5M2's FMAX x the smallest normal float32
  x[np.abs(x) < 57344.0 * np.finfo(np.float32).tiny] = 0.0
  return x


BLOCKS = [(1, 128), (128, 1), (128, 128), (2, 7)]


@settings(max_examples=40, deadline=None)
@given(
  x=arrays(),
  block_i=st.integers(0, len(BLOCKS) - 1),
  fmt=st.sampled_from(["e4m3", "e5m2"]),
  pow2=st.booleans(),
)
def test_quantize_bit_exact_vs_numpy(x, block_i, fmt, pow2):
  block = BLOCKS[block_i]
  q, s = jq(x, block, fmt, pow2)
  q_ref, s_ref = ref_quantize(x, block, fmt, pow2)
  assert s.shape == s_ref.shape and s.dtype == jnp.float32
  assert_bits_equal(q, q_ref, s, s_ref)


def test_per_tensor_block_and_3d():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 300)).astype(np.float32) * 37
  for block in [(3, 5, 300), (1, 2, 128), (2, 5, 100)]:
    q, s = quantize(x, block)
    q_ref, s_ref = ref_quantize(x, block)
    assert_bits_equal(q, q_ref, s, s_ref)


def test_values_at_and_beyond_fmax_clip_not_nan():
  # A tile whose amax is exactly FMAX has scale 1: values are cast directly.
  x = np.array([[448.0, -448.0, 464.0 / 2, 1.0]], np.float32)
  q, s = quantize(x, (1, 4))
  assert float(s[0, 0]) == pytest.approx(448.0 * np.float32(1 / 448.0))
  assert np.isfinite(np.asarray(q).astype(np.float32)).all()
  # Rounding of x * (1/scale) may land just above FMAX; clipping keeps it finite (no NaN).
  x = np.array([[1e30, -1e30, 3.0]], np.float32)
  q, s = quantize(x, (1, 3))
  qf = np.asarray(q).astype(np.float32)
  assert np.isfinite(qf).all() and abs(qf[0, 0]) == 448.0 and qf[0, 1] == -448.0


def test_zero_tile_scale_one_and_negative_zero():
  x = np.zeros((2, 256), np.float32)
  x[0, :128] = -0.0
  x[1, 200] = 3.0
  q, s = quantize(x, (1, 128))
  np.testing.assert_array_equal(np.asarray(s)[0], [1.0, 1.0])
  assert np.asarray(s)[1, 0] == 1.0 and np.asarray(s)[1, 1] != 1.0
  qb = np.asarray(q).view(np.uint8)
  assert (qb[0, :128] == 0x80).all(), "negative zero keeps its sign bit"
  assert (qb[0, 128:] == 0x00).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_non_finite_inputs_give_non_finite_outputs(bad, fmt):
  x = np.ones((2, 256), np.float32)
  x[0, 5] = bad
  q, s = quantize(x, (1, 128), FMT_DTYPE[fmt])
  d = np.asarray(dequantize(q, s, (1, 128)))
  assert not np.isfinite(d[0, :128]).any(), "the poisoned tile must not become finite garbage"
  assert np.isfinite(d[0, 128:]).all() and np.isfinite(d[1]).all(), "other tiles unaffected"


def test_dequantize_matches_reference_and_bf16_input():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((5, 300)) * 3).astype(ml_dtypes.bfloat16)
  q, s = quantize(jnp.asarray(x), (1, 128))
  q_ref, s_ref = ref_quantize(x.astype(np.float32), (1, 128))
  assert_bits_equal(q, q_ref, s, s_ref)
  np.testing.assert_array_equal(
    np.asarray(dequantize(q, s, (1, 128))),
    ref_dequantize(q_ref, s_ref, (1, 128)).astype(np.float32),
  )


def test_pow2_scales_are_powers_of_two_at_or_above():
  rng = np.random.default_rng(2)
  x = (rng.standard_normal((4, 384)) * 1e3).astype(np.float32)
  _, s = quantize(x, (1, 128), pow2_scale=True)
  s = np.asarray(s, np.float64)
  amax = np.abs(x.reshape(4, 3, 128)).max(-1).astype(np.float64)
  assert (np.log2(s) == np.round(np.log2(s))).all()
  assert (s >= amax / 448 * (1 - 1e-7)).all() and (s < 2 * amax / 448 * (1 + 1e-7)).all()


def test_rounding_is_nearest_even():
  # With scale forced to 1 (amax == 448), q = cast(x): 17 lies halfway between e4m3's 16 and
  # 18 -> even mantissa (16); 19 halfway between 18 and 20 -> 20.
  x = np.array([[448.0, 17.0, 19.0, -17.0]], np.float32)
  q, s = quantize(x, (1, 4))
  # scale = 448 * fl32(1/448) may differ from 1 by an ulp; check against the exact reference.
  q_ref, _ = ref_quantize(x, (1, 4))
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
  y = np.array([[17.0, 19.0]], np.float32).astype(F8["e4m3"]).astype(np.float32)
  np.testing.assert_array_equal(y, [[16.0, 20.0]])


def test_bad_block_is_a_clear_error():
  with pytest.raises(ValueError, match="one entry per axis"):
    quantize(np.ones((2, 3), np.float32), (128,))
  with pytest.raises(ValueError, match="positive"):
    quantize(np.ones((2, 3), np.float32), (0, 1))
  with pytest.raises(ValueError, match="FP8 dtype"):
    quantize(np.ones((2, 3), np.float32), (1, 3), jnp.bfloat16)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fast_fp8_cast_matches_ml_dtypes_around_every_fp8_value(fmt):
  from jetrl.precision.quantize import cast_to_fp8

  dt = F8[fmt]
  fmax = float(ml_dtypes.finfo(dt).max)
  grid = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
  grid = np.unique(grid[np.isfinite(grid) & (np.abs(grid) <= fmax)])
  mids = (grid[1:].astype(np.float64) + grid[:-1]) / 2  # exact ties: rounding to even
  pts = np.concatenate([grid, mids.astype(np.float32)])
  near = np.concatenate(
    [np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(-np.inf)), pts]
  )
  rng = np.random.default_rng(0)
  rand = (rng.standard_normal(20000) * np.exp(rng.standard_normal(20000) * 5)).astype(np.float32)
  x = np.clip(
    np.concatenate([near, rand, [np.nan, -np.nan, 0.0, -0.0, 1e-45, -1e-40]]), -fmax, fmax
  ).astype(np.float32)
  got = np.asarray(jax.jit(lambda a: cast_to_fp8(a, FMT_DTYPE[fmt]))(x))
  assert got.dtype == dt
  ref = x.astype(dt)
  nan = np.isnan(x)
  np.testing.assert_array_equal(got.view(np.uint8)[~nan], ref.view(np.uint8)[~nan])
  assert np.isnan(got[nan].astype(np.float32)).all()


def test_nan_makes_its_tile_scale_nan_at_every_shape():
  # XLA's vectorized CPU max drops NaN for some shapes (this one among them); the quantizer
  # must not: a NaN anywhere in a tile makes that tile's scale NaN.
  rng = np.random.default_rng(430)
  x = rng.standard_normal((130, 300)).astype(np.float32)
  x[3, 200] = np.nan
  x[77, 5] = np.nan
  _, s = quantize(jnp.asarray(x), (1, 128))
  nan = np.isnan(np.asarray(s))
  assert nan[3, 1] and nan[77, 0] and nan.sum() == 2
