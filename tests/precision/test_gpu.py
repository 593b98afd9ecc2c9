"""The FP8 GEMM backends on a real GPU: cuBLASLt against the XLA path and a float64 reference.

Skipped without an FP8-capable NVIDIA GPU (the CPU tests check the same code through a
host-side stand-in for cuBLASLt: test_cublaslt.py). Tolerances are docs/numerics.md's: the FP8
values and scales are bit-identical on every backend; the tensor cores sum each 128-product
block at their own accumulation precision before the float32 promotion, so results agree with
the float32 XLA path to 1e-3 of the output's largest magnitude.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import (
  Fp8Gemm,
  Precision,
  check_fp8_in_compiled,
  get_recipe,
  prequantize_weight,
  quantize,
  with_gemm_backend,
)
from jetrl.kernels import backend, cublaslt, linear

ON_GPU = backend.fp8_gpu_available()
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs an FP8-capable NVIDIA GPU")
TOL = 1e-3


def on_cpu(fn, *args):
  """fn(*args) jitted for the CPU device, lowered as a CPU program (quantize's cast is chosen
  when lowered: the CPU's), the GEMMs given on XLA: the spec's arithmetic (docs/numerics.md). On this GPU XLA's own quantization of a transposed (128 x 1) layout
  rounds a few values differently (double rounding through float16 at ties, seen on an H200
  with JAX 0.11.2: docs/device/2026-12-04-h200-1), so GPU XLA is no reference for it."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    return jax.jit(fn)(*(jax.device_put(a, cpu) for a in args))


def cublaslt_ready():
  reason = cublaslt.unavailable_reason()
  if reason is not None:
    pytest.skip(f"cuBLASLt FP8 GEMM unavailable: {reason}")


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize(
  "p,q,c,blocks",
  [(256, 1536, 1536, True), (64, 1536, 8960, True), (1536, 512, 4096, False), (8, 256, 640, True)],
)
def test_cublaslt_matches_float64_formula(p, q, c, blocks):
  cublaslt_ready()
  rng = np.random.default_rng(p + q + c)
  a = rng.standard_normal((p, c)).astype(np.float32).astype(jnp.float8_e4m3fn)
  b = rng.standard_normal((q, c)).astype(np.float32).astype(jnp.float8_e4m3fn)
  sa = rng.uniform(0.5, 2, (p, -(-c // 128))).astype(np.float32)
  sb = rng.uniform(0.5, 2, ((-(-q // 128)) if blocks else q, -(-c // 128))).astype(np.float32)
  out = jax.jit(lambda *x: cublaslt.gemm(*x, b_blocks=blocks, out_dtype=jnp.float32))(a, sa, b, sb)
  assert rel(out, cublaslt.reference(a, sa, b, sb, b_blocks=blocks)) < TOL


@pytest.mark.parametrize("gfmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("m,k,n", [(512, 1536, 8960), (300, 640, 200)])
def test_linear_on_cublaslt_matches_xla_path(gfmt, m, k, n):
  cublaslt_ready()
  g = dataclasses.replace(Fp8Gemm(), grad_fmt=gfmt)
  p32 = Precision("float32", fprop=g, dgrad=g, wgrad=g)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def fwd_bwd(p):
    return lambda a, b, d: (lambda y, vjp: (y,) + vjp(d))(
      *jax.vjp(lambda a_, b_: linear(a_, b_, p), a, b)
    )

  # The reference: the XLA path as a CPU program (the spec's FP8 values, float32 sums).
  ref = on_cpu(fwd_bwd(with_gemm_backend(p32, "xla")), x, w, dy)
  got = jax.jit(fwd_bwd(with_gemm_backend(p32, "cublaslt")))(x, w, dy)
  for name, a, b in zip(("y", "dx", "dw"), got, ref):
    assert rel(a, b) < TOL, name


def test_rollout_weights_give_the_training_forward():
  """The sampler's pre-quantized K-major weights and the training forward's own quantization
  feed the same kernel the same FP8 values: identical outputs."""
  cublaslt_ready()
  rec = get_recipe("jet")
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((64, 1536)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1536, 1024)) * 0.02, jnp.float32)
  qw = prequantize_weight(w, rec.rollout.fprop, k_major=True)
  a = jax.jit(lambda x_, w_: linear(x_, w_, rec.train))(x, w)
  b = jax.jit(lambda x_, q_: linear(x_, q_, rec.rollout))(x, qw)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_compiled_program_feeds_fp8_to_cublaslt():
  cublaslt_ready()
  jet = with_gemm_backend(get_recipe("jet").train, "cublaslt")
  x = jnp.ones((256, 1536), jnp.bfloat16)
  w = jnp.ones((1536, 1024), jnp.float32)
  # y squared: a plain sum's gradient does not need y, and the compiled program drops fprop.
  loss = lambda a, b: jnp.sum(jnp.square(linear(a, b, jet).astype(jnp.float32)))
  grad = jax.grad(loss, argnums=(0, 1))
  res = check_fp8_in_compiled(grad, x, w, require_all=True)
  assert res.ok, res.summary()
  assert sum("jetrl_fp8_blockwise_gemm" in g for g in res.fp8_gemms) == 3, res.summary()


def test_quantize_on_gpu_is_bit_identical_to_cpu():
  rng = np.random.default_rng(2)
  x = (rng.standard_normal((64, 640)) * np.exp(rng.standard_normal((64, 1)) * 3)).astype(np.float32)
  q_gpu, s_gpu = jax.jit(lambda a: quantize(a, (1, 128)))(x)
  q_cpu, s_cpu = jax.jit(lambda a: quantize(a, (1, 128)))(jax.device_put(x, jax.devices("cpu")[0]))
  np.testing.assert_array_equal(np.asarray(q_gpu).view(np.uint8), np.asarray(q_cpu).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s_gpu), np.asarray(s_cpu))


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_one_pass_quantization_kernel_is_bit_identical_on_gpu(fmt):
  from jetrl.kernels.quant_kernel import quantize_rows_cols

  rng = np.random.default_rng(3)
  x = rng.standard_normal((300, 520)) * np.exp(3 * rng.standard_normal((300, 1)))
  x[4, :128] = 0.0
  xb = jnp.asarray(x, jnp.bfloat16)
  (qr, sr_t), (qc_t, sc_t) = jax.jit(lambda a: quantize_rows_cols(a, fmt))(xb)
  ref_r = on_cpu(lambda a: quantize(a, (1, 128), fmt), xb)
  ref_c = on_cpu(lambda a: quantize(a.T, (1, 128), fmt), xb)
  for got, ref in ((qr, ref_r[0]), (qc_t, ref_c[0])):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(sr_t.T), np.asarray(ref_r[1]))
  np.testing.assert_array_equal(np.asarray(sc_t.T), np.asarray(ref_c[1]))
