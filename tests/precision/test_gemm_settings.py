"""A rollout weight's block scales padded once for cuBLASLt (`gemms.with_gemm_scales`): the
padding is 1.0, only where the library's leading dimension needs it, and every other reader
of the weight (`kn`, `nk`) sees the scales as quantized. Also the one-pass quantization
kernel's default (on for a GPU) and its setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.kernels import cublaslt, gemms
from jetrl.precision import get_recipe, prequantize_weight, quantize


@pytest.mark.parametrize("k, pad", [(1536, 0), (8960, 2), (384, 1), (640, 3)])
def test_scale_padding_reaches_a_multiple_of_four_blocks(k, pad):
  assert cublaslt.scale_padding(k) == pad  # ceil(K / 128) rounded up to 4, by hand


def test_padded_scales_read_back_as_quantized(monkeypatch):
  g = get_recipe("jet").rollout.fprop
  w = jax.random.normal(jax.random.PRNGKey(0), (2, 640, 256), jnp.float32)  # two layers
  wq = prequantize_weight(w, g, k_major=True)
  monkeypatch.setattr(gemms._backend, "resolve", lambda *_: "xla")
  assert gemms.with_gemm_scales(wq, g) is wq  # XLA's GEMM reads scales unpadded
  monkeypatch.setattr(gemms._backend, "resolve", lambda *_: "cublaslt")
  padded = gemms.with_gemm_scales(wq, g)
  assert padded.scale_pad == 3 and padded.scale.shape == (2, 2, 8)
  np.testing.assert_array_equal(np.asarray(padded.scale[..., 5:]), 1.0)
  layer = jax.tree_util.tree_map(lambda a: a[1], padded)  # a layer sliced, as rollouts do
  q, s = quantize(w[1].T, (128, 128), jnp.float8_e4m3fn)
  for got, want in ((layer.nk(), (q, s)), (layer.kn(), (q.T, s.T))):
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  assert layer.nk_padded()[1].shape == (2, 8)


def test_the_one_pass_quantization_default_and_a_bad_setting():
  from jetrl.kernels import Device, KernelConfig

  assert not gemms.fused_quant_enabled(Device("cpu"))  # off for a CPU
  assert gemms.fused_quant_enabled(Device("gpu", "9.0", compiling=True))  # on for a GPU
  off = Device("gpu", "9.0", compiling=True, kernels=KernelConfig(fused_quant=False))
  assert not gemms.fused_quant_enabled(off)
  assert KernelConfig.from_env({"JETRL_FUSED_QUANT": "0"}).fused_quant is False
  with pytest.raises(ValueError, match="JETRL_FUSED_QUANT must be 0, 1 or unset"):
    KernelConfig.from_env({"JETRL_FUSED_QUANT": "yes"})
