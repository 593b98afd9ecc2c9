"""The decode-size FP8 GEMM (`gemm_pallas.decode_matmul_nt`, KernelConfig(decode_gemm="pallas")): in
interpret mode against a float64 evaluation of the FP8 formula (each K-block's dot of FP8
values times the row's group scale and the column block's weight scale), its shape checks,
its FP8 dot in the program lowered for a GPU, and the setting that routes a decode step's
GEMMs to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import (
  QuantizedInput,
  check_fp8_in_compiled,
  get_recipe,
  prequantize_weight,
  quantize,
)
from jetrl.kernels import gemm_pallas as gp
from jetrl.kernels import Device, KernelConfig, gemms, linear, resolve_plan


def _f64(xq, xs, wq, ws):
  """sum_kb xs[m, kb] ws[n // 128, kb] (xq[m, kb] . wq[n, kb]) in float64."""
  m, k = xq.shape
  n = wq.shape[0]
  x = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64), 128, 1)[:, :k]
  s = np.repeat(np.repeat(np.asarray(ws, np.float64), 128, 0), 128, 1)[:n, :k]
  return x @ (np.asarray(wq, np.float64) * s).T


@pytest.mark.parametrize(
  "m, k, n, bn", [(64, 1536, 2048, 32), (16, 256, 96, 32), (32, 384, 128, 16)]
)
def test_decode_gemm_matches_float64(m, k, n, bn):
  rng = np.random.default_rng(m + k + n)
  x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1))), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.float32)
  xq, xs = quantize(x, (1, 128))
  wq, ws = quantize(w, (128, 128))
  padded = jnp.pad(ws, ((0, 0), (0, 3)), constant_values=1.0)  # cuBLASLt's padding: not read
  with jax.default_device(jax.devices("cpu")[0]):
    got = gp.decode_matmul_nt(xq, xs.T, wq, padded, bn=bn, out_dtype=jnp.float32, interpret=True)
  ref = _f64(xq, xs, wq, ws)
  assert np.abs(np.asarray(got, np.float64) - ref).max() <= 1e-6 * np.abs(ref).max()


def test_decode_gemm_refuses_what_it_cannot_take():
  xq = jnp.zeros((24, 256), jnp.float8_e4m3fn)  # 24 rows: not a power of two
  wq = jnp.zeros((64, 256), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="power of two"):
    gp.decode_matmul_nt(xq, jnp.ones((2, 24)), wq, jnp.ones((1, 2)), interpret=True)
  xq = jnp.zeros((16, 256), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="scales"):
    gp.decode_matmul_nt(xq, jnp.ones((16, 2)), wq, jnp.ones((1, 2)), interpret=True)
  assert gp.decode_supported(64, 2048, 1536) and not gp.decode_supported(8, 2048, 1536)
  assert not gp.decode_supported(64, 2048, 1000) and not gp.decode_supported(64, 2040, 1536)


def test_lowered_for_a_gpu_it_feeds_fp8_to_the_dot():
  xq = jnp.zeros((64, 256), jnp.float8_e4m3fn)
  wq = jnp.zeros((128, 256), jnp.float8_e4m3fn)
  res = check_fp8_in_compiled(
    lambda a, s, b, t: gp.decode_matmul_nt(a, s, b, t),
    xq,
    jnp.ones((2, 64)),
    wq,
    jnp.ones((1, 2)),
    platform="cuda",
    compile=False,
    require_all=True,
  )
  assert res.ok and len(res.fp8_gemms) == 1, res.summary()
  assert res.kernel_dots and all(
    d.startswith("tt.dot(f8E4M3FN, f8E4M3FN)") for d in res.kernel_dots
  )


def test_the_setting_routes_a_decode_step_gemm(monkeypatch):
  """Traced for a GPU with cuBLASLt as the backend: the default runs a QuantizedInput's GEMM
  on cuBLASLt's FFI call, `KernelConfig(decode_gemm="pallas")` on the decode kernel; a bad
  value is refused, naming the field (or the variable it is read from)."""
  rollout = get_recipe("jet").rollout
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.bfloat16)
  q, s = quantize(x, (1, 128))
  wq = prequantize_weight(jnp.ones((256, 128), jnp.float32), rollout.fprop, k_major=True)
  monkeypatch.setattr(gemms, "_choose", lambda *a, **k: "cublaslt")
  gpu = lambda kernels: Device("gpu", "9.0", compiling=True, kernels=kernels)
  trace = lambda kernels: str(
    jax.make_jaxpr(
      lambda a, b: linear(QuantizedInput(a, b), wq, rollout, resolve_plan(rollout, gpu(kernels)))
    )(q, s.T)
  )
  default = trace(KernelConfig())
  assert "jetrl_fp8_blockwise_gemm" in default and "fp8_decode_gemm" not in default
  pallas = trace(KernelConfig(decode_gemm="pallas"))
  assert "fp8_decode_gemm" in pallas and "jetrl_fp8_blockwise_gemm" not in pallas
  with pytest.raises(ValueError, match="decode_gemm: 'triton' is not accepted"):
    KernelConfig(decode_gemm="triton")
  with pytest.raises(ValueError, match="JETRL_DECODE_GEMM must be one of"):
    KernelConfig.from_env({"JETRL_DECODE_GEMM": "triton"})
