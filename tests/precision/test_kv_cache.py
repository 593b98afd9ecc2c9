"""The FP8 KV cache's numerics (jetrl.precision.kv_cache): keys and values quantized per token
and kv head in E4M3, 1 x 128 groups along the head dimension, against a float64 numpy
implementation written here; the straight-through gradient; the recipe option."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jetrl.precision import KV_CACHE_RECIPES, RECIPES, get_recipe
from jetrl.precision.kv_cache import dequantize_kv, quantize_kv, round_kv

E4M3 = ml_dtypes.float8_e4m3fn


def _reference(x):
  """(q, scale, x as attention reads it) of x [..., Dh] (bf16 values), written from the spec:
  each [128] slice of the last axis (the last one shorter when Dh is not a multiple of 128)
  of each token and head is one group; amax in float64, scale = float32(amax * float32(1 /
  448)) (1 for a zero group), q = E4M3(clip(float32(x * float32(1 / scale)))) rounded to
  nearest even by ml_dtypes; read back as bf16(float32(q) * scale)."""
  x = np.asarray(x, np.float32)
  *lead, dh = x.shape
  groups = -(-dh // 128)
  q = np.zeros(x.shape, E4M3)
  scale = np.zeros((*lead, groups), np.float32)
  read = np.zeros(x.shape, np.float32)
  r = np.float32(1.0) / np.float32(448.0)
  for idx in np.ndindex(*lead):
    for g in range(groups):
      cols = slice(128 * g, min(128 * (g + 1), dh))
      tile = x[idx][cols]
      amax = np.max(np.abs(tile.astype(np.float64)))
      s = np.float32(np.float32(amax) * r)
      s = np.float32(1.0) if s == 0 else s
      inv = np.float32(np.float32(1.0) / s)
      qt = np.clip((tile * inv).astype(np.float32), -448.0, 448.0).astype(E4M3)
      q[idx][cols], scale[idx + (g,)] = qt, s
      deq = np.float64(qt.astype(np.float32)) * np.float64(s)  # exact: 4 x 24 bits
      read[idx][cols] = np.float32(deq).astype(ml_dtypes.bfloat16).astype(np.float32)
  return q, scale, read


def _keys(shape, seed=0):
  """bf16 keys with groups of very different magnitudes, a zero group and a negative zero."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * np.exp(rng.uniform(-8, 8, size=shape[:-1] + (1,)))
  x = x.astype(np.float32)
  x[(0,) * (len(shape) - 1)] = 0.0
  x.reshape(-1)[-1] = -0.0
  return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("dh", [64, 128, 192, 256])
def test_quantize_and_read_back_match_the_float64_reference(dh):
  """Head sizes of one group (64, 128), two (256) and one and a half (192: a group of 128,
  then one of the remaining 64): FP8 bytes, scale bits and the bf16 values read back."""
  x = _keys((2, 3, 5, dh), seed=dh)  # [B, Hkv, S, Dh]
  q, s = jax.jit(quantize_kv)(x)
  want_q, want_s, want_read = _reference(x)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
  assert s.shape == (2, 3, 5, -(-dh // 128))
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s).view(np.uint32), want_s.view(np.uint32))
  read = jax.jit(lambda q, s: dequantize_kv(q, s, jnp.bfloat16))(q, s)
  assert read.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(read, np.float32), want_read)
  np.testing.assert_array_equal(np.asarray(jax.jit(round_kv)(x), np.float32), want_read)
  # Nothing beyond E4M3's 3 mantissa bits survives: the rounding is real.
  assert np.any(want_read != np.asarray(x, np.float32))


def test_groups_are_per_token_and_head():
  """A group's scale is its own: scaling one token's head by 2^10 changes no other value."""
  x = _keys((1, 2, 4, 64), seed=1)
  big = x.at[0, 1, 2].multiply(1024.0)
  a, b = np.asarray(round_kv(x), np.float32), np.asarray(round_kv(big), np.float32)
  other = np.ones(a.shape, bool)
  other[0, 1, 2] = False
  np.testing.assert_array_equal(a[other], b[other])
  np.testing.assert_array_equal(a[0, 1, 2] * 1024.0, b[0, 1, 2])  # a power of two: exact


def test_a_nan_spoils_its_group_only():
  x = _keys((1, 1, 2, 192), seed=2).at[0, 0, 0, 5].set(jnp.nan)
  r = np.asarray(round_kv(x), np.float32)
  assert np.isnan(r[0, 0, 0, :128]).all()  # the first group of the first token
  assert np.isfinite(r[0, 0, 0, 128:]).all() and np.isfinite(r[0, 0, 1]).all()


def test_the_gradient_passes_straight_through_the_rounding():
  """Hand check: L(x) = sum(w * round(x)^2) has the straight-through gradient 2 w round(x)
  (the gradient of sum(w * y^2) at y = round(x), with d round / dx taken as 1), not 2 w x."""
  x = jnp.asarray([[0.3, -1.7, 5.1, 0.013] + [0.0] * 60], jnp.float32)
  w = jnp.arange(1.0, 65.0, dtype=jnp.float32)[None]
  y = round_kv(x)
  # 5.1 is the group's amax: scale 5.1 / 448; 0.3 and 0.013 lie between E4M3 values there.
  assert float(y[0, 0]) != 0.3 and float(y[0, 3]) != 0.013
  g = jax.grad(lambda x: jnp.sum(w * round_kv(x) ** 2))(x)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(2.0 * w * y))
  # Through attention: the gradient of a loss of attention over rounded keys and values is
  # the gradient of the same loss without rounding, at the rounded point.
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(4, 64)), jnp.float32) for _ in range(3))

  def attention(k, v):
    p = jax.nn.softmax(q @ k.T / 8.0, axis=-1)
    return jnp.sum(jnp.sin(p @ v))

  through = jax.grad(lambda k, v: attention(round_kv(k), round_kv(v)), argnums=(0, 1))(k, v)
  at_point = jax.grad(attention, argnums=(0, 1))(round_kv(k), round_kv(v))
  for a, b in zip(through, at_point):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_recipe_option():
  assert KV_CACHE_RECIPES == ("fp8_rollout", "jet", "jet_exact")
  for name in ("jet", "jet_exact"):
    r = get_recipe(name, kv_cache="fp8")
    # Unified: the training forward reads what the rollout's cache holds.
    assert r.unified and r.train.kv_cache == "fp8" and r.rollout.kv_cache == "fp8"
    assert r.rollout.fprop is r.train.fprop
    assert r.rollout == r.train.forward and r.rollout != get_recipe(name).rollout
    hash(r.train), hash(r.rollout)
    assert get_recipe(name).train.kv_cache == "compute"  # off by default
  fr = get_recipe("fp8_rollout", kv_cache="fp8")
  # An inference engine's FP8 cache: the rollout only, the bf16 trainer never sees it.
  assert fr.rollout.kv_cache == "fp8" and fr.train.kv_cache == "compute" and not fr.unified
  for name in RECIPES:
    if name not in KV_CACHE_RECIPES:
      with pytest.raises(ValueError, match=f"kv_cache 'fp8' needs .*{name!r}"):
        get_recipe(name, kv_cache="fp8")
  with pytest.raises(ValueError, match="unknown kv_cache 'int8'"):
    get_recipe("jet", kv_cache="int8")
