"""`quantize_rows_t` (1x128 groups, scales written transposed for cuBLASLt) against the
float64 numpy reference and, bit for bit, against `quantize`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import ref_quantize
from jetrl.precision import quantize
from jetrl.precision.quantize import quantize_rows_t
from test_quant_kernel import assert_same


@pytest.mark.parametrize(
  "m, k, fmt, pow2",
  [(64, 1536, "e4m3", False), (130, 300, "e4m3", False), (7, 200, "e5m2", True)],
)
def test_rows_t_is_quantize_with_its_scales_transposed(m, k, fmt, pow2):
  dtype = jnp.float8_e4m3fn if fmt == "e4m3" else jnp.float8_e5m2
  rng = np.random.default_rng(m * k)
  x = (rng.standard_normal((m, k)) * np.exp(3 * rng.standard_normal((m, 1)))).astype(np.float32)
  x[1, :128] = 0.0  # an all-zero group: scale 1
  x[2, 150] = np.nan  # poisons its group only
  xb = jnp.asarray(x, jnp.bfloat16)
  q, s_t = jax.jit(lambda a: quantize_rows_t(a, 128, dtype, pow2))(xb)
  assert q.shape == (m, k) and q.dtype == dtype and s_t.shape == (-(-k // 128), m)
  ref_q, ref_s = quantize(xb, (1, 128), dtype, pow2)
  assert_same(q, ref_q)
  assert_same(s_t.T, ref_s)
  # The independent reference (float64 numpy, ml_dtypes rounding), away from the NaN row.
  rq, rs = ref_quantize(np.asarray(xb, np.float32)[3:], (1, 128), fmt, pow2)
  np.testing.assert_array_equal(np.asarray(s_t.T)[3:], rs)
  np.testing.assert_array_equal(np.asarray(q[3:], np.float32), np.asarray(rq, np.float32))
  assert float(s_t[0, 1]) == 1.0
  assert np.isnan(np.asarray(q[2], np.float32)[128:256]).all()


def test_rows_t_refuses_other_ranks():
  with pytest.raises(ValueError, match="must be 2-D"):
    quantize_rows_t(jnp.zeros((2, 3, 128)), 128)


@pytest.mark.parametrize("m, k", [(64, 1536), (8, 256), (200, 128)])
def test_the_decode_kernel_is_quantize_bit_for_bit(m, k):
  """The one-pass Pallas kernel a GPU's decode step quantizes with (interpret mode here):
  row blocks of row_block(m) rows, scales transposed."""
  from jetrl.kernels import quant_kernel as qk

  rng = np.random.default_rng(k)
  x = (rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((m, 1)))).astype(np.float32)
  x[0, :128] = 0.0
  x[-1, -1] = np.nan
  xb = jnp.asarray(x, jnp.bfloat16)
  q, s_t = jax.jit(lambda a: qk.quantize_rows_t(a, jnp.float8_e4m3fn, interpret=True))(xb)
  ref_q, ref_s = quantize(xb, (1, 128), jnp.float8_e4m3fn)
  assert_same(q, ref_q)
  assert_same(s_t.T, ref_s)
  assert qk.row_block(m) == {64: 64, 8: 8, 200: 8}[m]


def test_the_decode_kernel_refuses_shapes_it_does_not_tile():
  from jetrl.kernels import quant_kernel as qk

  assert qk.row_block(12) == 0
  with pytest.raises(ValueError, match="multiple of 8"):
    qk.quantize_rows_t(jnp.zeros((12, 128)), jnp.float8_e4m3fn, interpret=True)
  with pytest.raises(ValueError, match="multiple of 128"):
    qk.quantize_rows_t(jnp.zeros((16, 100)), jnp.float8_e4m3fn, interpret=True)
