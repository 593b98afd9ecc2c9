"""The cuBLASLt FP8 GEMM's plumbing, on the CPU.

The C++ handler is built for XLA's CPU backend and loaded against `cublaslt_host_stub.cc`, a
host-memory implementation of cuBLAS's column-major contract and of the 1x128 / 128x128
scale layouts. That checks everything between `cublaslt.gemm` and the library call (operand
order, transposes, leading dimensions, padding, scale layouts, dtypes) against a float64 numpy
reference written here. Whether the real cuBLASLt reads the layouts the same way is checked
on a GPU (the self-check at load time, and tests/precision/test_gpu.py).
"""

import ctypes
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.kernels import cublaslt

HERE = Path(__file__).parent

# On a GPU the real library is loaded and checked (test_gpu.py); the stand-in's symbols must
# not enter that process.
pytestmark = [
  pytest.mark.skipif(cublaslt.compiler() is None, reason="no C++ compiler"),
  pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="a GPU is present: test_gpu.py checks the real cuBLASLt"
  ),
]


@pytest.fixture(scope="module")
def host_gemm(tmp_path_factory):
  out = tmp_path_factory.mktemp("ffi")
  stub = cublaslt.build(HERE / "cublaslt_host_stub.cc", out_dir=out)
  ctypes.CDLL(str(stub), mode=os.RTLD_GLOBAL)
  lib = cublaslt.build(cublaslt.SOURCE, defines=("JETRL_FFI_HOST_TEST",), out_dir=out)
  saved = (cublaslt._State.lib, cublaslt._State.reason, dict(cublaslt._State.info))
  reason = cublaslt.load(_platform="cpu", _library=lib, _skip_gpu_check=True)
  assert reason is None, reason  # the load-time self-check passed through the stub
  cublaslt.unavailable_reason.cache_clear()
  yield cublaslt.gemm
  cublaslt._State.lib, cublaslt._State.reason, cublaslt._State.info = saved
  cublaslt.supported.cache_clear()
  cublaslt.unavailable_reason.cache_clear()


def blockwise_ref(a, sa, b, sb, blocks):
  """sum over 128-blocks of sa * sb * (a_blk . b_blk), float64, written independently."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  p, c = a.shape
  q = b.shape[0]
  out = np.zeros((p, q))
  for i in range(p):
    for kb in range(-(-c // 128)):
      cols = slice(128 * kb, min(c, 128 * kb + 128))
      row_scale = sb[np.arange(q) // 128, kb] if blocks else sb[:, kb]
      out[i] += sa[i, kb] * row_scale * (b[:, cols] @ a[i, cols])
  return out


def operands(rng, p, q, c, blocks, b_fmt=jnp.float8_e4m3fn):
  a = rng.standard_normal((p, c)).astype(np.float32).astype(jnp.float8_e4m3fn)
  b = (4 * rng.standard_normal((q, c))).astype(np.float32).astype(b_fmt)
  sa = rng.uniform(0.25, 4.0, (p, -(-c // 128))).astype(np.float32)
  rows = -(-q // 128) if blocks else q
  sb = rng.uniform(0.25, 4.0, (rows, -(-c // 128))).astype(np.float32)
  return a, sa, b, sb


@pytest.mark.parametrize(
  "p,q,c,blocks,out_dtype",
  [
    (32, 256, 512, True, jnp.float32),  # aligned: no padding
    (5, 200, 300, True, jnp.bfloat16),  # decode-sized rows, ragged N and K blocks
    (130, 48, 640, False, jnp.float32),  # wgrad-style: 1x128 groups on both operands
    (17, 144, 136, False, jnp.bfloat16),
  ],
)
def test_gemm_matches_float64_blockwise_formula(host_gemm, p, q, c, blocks, out_dtype):
  rng = np.random.default_rng(p * q + c)
  a, sa, b, sb = operands(rng, p, q, c, blocks)
  out = jax.jit(lambda *xs: host_gemm(*xs, b_blocks=blocks, out_dtype=out_dtype))(a, sa, b, sb)
  ref = blockwise_ref(a, sa, b, sb, blocks)
  assert out.shape == (p, q) and out.dtype == out_dtype
  tol = 1e-6 if out_dtype == jnp.float32 else 8e-3
  err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
  assert err < tol, err


def test_gemm_mixed_formats(host_gemm):
  rng = np.random.default_rng(3)
  a, sa, b, sb = operands(rng, 64, 128, 256, False, jnp.float8_e5m2)
  out = host_gemm(a, sa, b, sb, b_blocks=False, out_dtype=jnp.float32)
  ref = blockwise_ref(a, sa, b, sb, False)
  assert np.abs(np.asarray(out) - ref).max() / np.abs(ref).max() < 1e-6


def test_gemm_rejects_mismatched_scales(host_gemm):
  rng = np.random.default_rng(4)
  a, sa, b, sb = operands(rng, 8, 256, 256, True)
  with pytest.raises(ValueError, match="b_scale"):
    host_gemm(a, sa, b, sb[:1], b_blocks=True)
  with pytest.raises(ValueError, match="a_scale"):
    host_gemm(a, sa[:, :1], b, sb, b_blocks=True)


def test_supported_queries_the_library(host_gemm):
  del host_gemm
  assert cublaslt.supported(64, 128, 256, jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.bfloat16, True)
  # bf16 operands are not an FP8 GEMM; FP8 output is not offered.
  assert not cublaslt.supported(64, 128, 256, jnp.bfloat16, jnp.float8_e4m3fn, jnp.bfloat16, True)
  assert not cublaslt.supported(
    64, 128, 256, jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e4m3fn, True
  )


def test_unavailable_without_gpu_says_why():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  assert "no GPU" in cublaslt._gpu_reason()


def test_build_error_names_the_problem(tmp_path):
  bad = tmp_path / "bad.cc"
  bad.write_text("this is not C++\n")
  with pytest.raises(RuntimeError, match="bad.cc failed"):
    cublaslt.build(bad, out_dir=tmp_path)
  assert not list(tmp_path.glob("*.so"))  # no partial library left behind


def test_build_is_cached(tmp_path):
  src = tmp_path / "ok.cc"
  src.write_text('extern "C" int f() { return 1; }\n')
  first = cublaslt.build(src, out_dir=tmp_path)
  mtime = first.stat().st_mtime_ns
  assert cublaslt.build(src, out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("fused", [False, True])
def test_linear_on_the_cublaslt_path_matches_the_xla_path(host_gemm, monkeypatch, fused):
  """fprop, dgrad and wgrad of `linear` routed through the cuBLASLt code path (K-major weight
  blocks, transposed wgrad operands, the one-pass quantization kernel when fused) against the
  XLA path: the stand-in sums in float64, so only float32 rounding separates them."""
  import dataclasses
  from jetrl.kernels import KernelConfig, linear, resolve_plan
  from jetrl.precision import Fp8Gemm, Precision, with_gemm_backend

  del host_gemm
  kernels = KernelConfig(fused_quant=fused)
  if True:
    g = dataclasses.replace(Fp8Gemm(), grad_fmt="e5m2")
    p32 = Precision("float32", fprop=g, dgrad=g, wgrad=g)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((130, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 200)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((130, 200)), jnp.float32)
    outs = {}
    for be in ("xla", "cublaslt"):
      p = with_gemm_backend(p32, be)
      plan = resolve_plan(p, kernels)
      y, vjp = jax.vjp(lambda a, b, p=p, plan=plan: linear(a, b, p, plan), x, w)
      outs[be] = (y,) + vjp(dy)
    for got, ref in zip(outs["cublaslt"], outs["xla"]):
      ref = np.asarray(ref, np.float64)
      assert np.abs(np.asarray(got, np.float64) - ref).max() <= 1e-5 * np.abs(ref).max()
