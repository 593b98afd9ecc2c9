"""RMSNorm's kernel with both FP8 layouts (Pallas interpret mode here): its bf16 output against
float64 and XLA's `rms_norm_cd`, every FP8 group against `quantize` of that value, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import quantize
from jetrl.kernels.norm_kernel import norm_rows_cols, rms_norm_cd

BF16, E4M3, E5M2 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2
M, D, EPS = 256, 384, 1e-6


def _bits(a):
  return np.asarray(a).view(np.uint8 if np.dtype(a.dtype).itemsize == 1 else np.uint16)


@pytest.fixture(scope="module")
def run():
  rng = np.random.default_rng(5)
  x = rng.normal(size=(M, D)) * np.exp(2 * rng.normal(size=(M, 1)))
  x[3] = 0.0  # a zero row: its norm is 0, every group's scale 1
  x = jnp.asarray(x, BF16)
  w = jnp.asarray(1 + 0.2 * rng.normal(size=(D,)), jnp.float32)  # a float32 master weight
  out = jax.jit(
    lambda a, b: norm_rows_cols(a, b, EPS, BF16, E4M3, E5M2, interpret=True, values=True)
  )(x, w)
  return x, w, out


def test_the_norm_is_rms_norm_in_float64_and_xlas_value(run):
  x, w, (_, _, h) = run
  X = np.asarray(x, np.float64)
  W = np.asarray(jnp.asarray(w, BF16), np.float64)  # the model multiplies by the weight in bf16
  ref = X / np.sqrt(np.mean(X * X, axis=1, keepdims=True) + EPS) * W
  ulp = 2.0**-8
  assert np.all(np.abs(np.asarray(h, np.float64) - ref) <= 2.5 * ulp * np.abs(ref))
  xla = rms_norm_cd(x, w, EPS, BF16)  # the statistic summed in another order: a last bit
  assert np.mean(_bits(h) == _bits(xla)) > 0.95
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(xla, np.float32), rtol=2**-7)


def test_both_layouts_are_quantize_of_the_norm(run):
  _, _, ((q, s_t), (q_t, s), h) = run
  want_q, want_s = quantize(h, (1, 128), E4M3)
  np.testing.assert_array_equal(_bits(q), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(s_t).T, np.asarray(want_s))
  want_q, want_s = quantize(h.T, (1, 128), E5M2)  # 128 x 1 groups of h, transposed
  np.testing.assert_array_equal(_bits(q_t), _bits(want_q))
  np.testing.assert_array_equal(np.asarray(s).T, np.asarray(want_s))
  assert np.all(np.asarray(s_t)[:, 3] == 1.0) and np.all(np.asarray(q, np.float32)[3] == 0)


def test_shapes_off_the_tile_are_refused():
  with pytest.raises(ValueError, match="multiples of 128"):
    norm_rows_cols(jnp.zeros((200, 256), BF16), jnp.ones((256,)), EPS, BF16, E4M3, E4M3)
  with pytest.raises(ValueError, match="weight \\[D\\]"):
    norm_rows_cols(jnp.zeros((256, 256), BF16), jnp.ones((128,)), EPS, BF16, E4M3, E4M3)
