"""The one-pass rows + columns quantization kernel (Pallas interpret mode here) against
`quantize`: bit-identical FP8 values and scales, both layouts, ragged shapes, odd values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import quantize
from jetrl.kernels.quant_kernel import quantize_rows_cols


def _bits(a):
  return np.asarray(a).view(np.uint8 if np.dtype(a.dtype).itemsize == 1 else np.uint32)


def assert_same(a, b):
  """Same bits, except that a NaN may be any NaN (XLA's convert and ml_dtypes pick different
  E5M2 NaN codes)."""
  na, nb = np.isnan(np.asarray(a, np.float32)), np.isnan(np.asarray(b, np.float32))
  np.testing.assert_array_equal(na, nb)
  np.testing.assert_array_equal(np.where(na, 0, _bits(a)), np.where(nb, 0, _bits(b)))


@pytest.mark.parametrize("m,k,fmt", [(130, 300, jnp.float8_e4m3fn), (64, 256, jnp.float8_e5m2)])
def test_rows_and_cols_match_quantize(m, k, fmt):
  rng = np.random.default_rng(m + k)
  x = (rng.standard_normal((m, k)) * np.exp(3 * rng.standard_normal((m, 1)))).astype(np.float32)
  x[5, :128] = 0.0  # an all-zero 1x128 group: scale 1
  x[:, 7] *= 1e30  # beyond FMAX after scaling? no: the scale follows amax
  x[3, 200] = np.nan  # NaN poisons its row group and its column group
  x[9, 11] = -0.0
  xb = jnp.asarray(x, jnp.bfloat16)
  (qr, sr_t), (qc_t, sc_t) = jax.jit(lambda a: quantize_rows_cols(a, fmt, interpret=True))(xb)
  ref_qr, ref_sr = quantize(xb, (1, 128), fmt)
  ref_qc, ref_sc = quantize(xb.T, (1, 128), fmt)
  assert_same(qr, ref_qr)
  assert_same(sr_t.T, ref_sr)
  assert_same(qc_t, ref_qc)
  assert_same(sc_t.T, ref_sc)
  assert np.isnan(np.asarray(qr[3], np.float32)[128:256]).all()  # the NaN's row group
  assert qr.shape == (m, k) and qc_t.shape == (k, m)
  assert sr_t.shape == (-(-k // 128), m) and sc_t.shape == (-(-m // 128), k)


def test_one_layout_at_a_time():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((40, 200)), jnp.float32)
  (only_rows,) = quantize_rows_cols(x, jnp.float8_e4m3fn, cols=False, interpret=True)
  (only_cols,) = quantize_rows_cols(x, jnp.float8_e4m3fn, rows=False, interpret=True)
  assert_same(only_rows[0], quantize(x, (1, 128))[0])
  assert_same(only_cols[0], quantize(x.T, (1, 128))[0])
  with pytest.raises(ValueError, match="rows, cols or both"):
    quantize_rows_cols(x, jnp.float8_e4m3fn, rows=False, cols=False)


def test_the_compiled_kernel_divides_correctly_rounded():
  """Compiled for a GPU (lowered for 'cuda' here), the kernel's 1 / scale is PTX's div.rn.f32:
  Triton's own float32 `/` is div.full.f32, up to 2 ulp off XLA's (correctly rounded) division
  in `quantize`, which would change FP8 values near a rounding boundary. The Triton IR holds
  the inline division and no float division op."""
  x = jnp.ones((256, 256), jnp.bfloat16)
  program = jax.jit(lambda a: quantize_rows_cols(a, jnp.float8_e4m3fn))
  text = program.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text  # the Pallas kernel, its Triton IR serialized inside
  assert "div.rn.f32" in text and "arith.divf" not in text and "divf" not in text
