"""The blockwise FP8 Pallas GEMM: kernel against a float64 reference, `linear` through the kernel
(Pallas interpret mode) against the XLA path, backend selection, and the FP8-in-program check.

Interpret mode runs the kernel's program on the CPU, one grid step at a time: shapes are small.
On a machine with a GPU these tests still run it on the CPU device (`on_cpu`), against the
explicit XLA path: there the program's FP8 block dots would be XLA GPU dots, summed at the
tensor cores' precision, which the compiled-kernel test below and test_gpu.py check instead.
"""

import contextlib
import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import ref_quantize
from jetrl.precision import (
  GEMM_BACKENDS,
  Fp8Gemm,
  Precision,
  check_fp8_in_compiled,
  get_recipe,
  quantize,
  with_gemm_backend,
)
from jetrl.kernels import KernelConfig, backend, current_device, gemm_pallas, linear
from jetrl.kernels import scaled_matmul_nt
from jetrl.precision import fp8_checks

BLOCK = Fp8Gemm()
M, K, N = 130, 300, 200  # partial token tiles, partial K and N blocks
ON_FP8_GPU = backend.fp8_gpu_available()


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


def _interp(prec):
  return with_gemm_backend(prec, "pallas_interpret")


def _xla(prec):
  """The reference path, named: on a GPU "auto" would pick a GPU kernel."""
  return with_gemm_backend(prec, "xla")


def _square_sum(y):
  """A loss whose gradient needs y itself, so that the forward GEMM is not dead code."""
  return jnp.sum(jnp.square(y.astype(jnp.float32)))


def on_cpu():
  """Run what follows on the CPU device (the default device already, without a GPU)."""
  if jax.default_backend() == "cpu":
    return contextlib.nullcontext()
  return jax.default_device(jax.devices("cpu")[0])


@pytest.fixture(scope="module")
def xwd():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)).astype(np.float32) * np.exp(rng.standard_normal((M, 1)))
  w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
  dy = (rng.standard_normal((M, N)) * 1e-3).astype(np.float32)
  return x, w, dy


# --- the kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "p,q,c,tiles",
  [
    (
      70,
      90,
      300,
      gemm_pallas.Tiles(bm=16, bn=32, num_warps=4, group_m=2),
    ),  # 5x3 tiles, ragged groups
    (8, 40, 256, None),  # decode-sized rows
  ],
)
def test_kernel_matches_float64_reference(p, q, c, tiles):
  rng = np.random.default_rng(1)
  a32, b32 = rng.standard_normal((p, c)), rng.standard_normal((q, c))
  aq, sa = ref_quantize(a32, (1, 128))
  bq, sb = ref_quantize(b32, (1, 128), "e5m2" if tiles is None else "e4m3")
  with on_cpu():
    out = scaled_matmul_nt(
      jnp.asarray(aq),
      jnp.asarray(sa),
      jnp.asarray(bq),
      jnp.asarray(sb),
      out_dtype=jnp.float32,
      interpret=True,
      tiles=tiles,
    )
  ref = np.zeros((p, q))
  for kb in range(sa.shape[1]):
    sl = slice(128 * kb, 128 * (kb + 1))
    ref += np.outer(sa[:, kb], sb[:, kb]) * (
      aq[:, sl].astype(np.float64) @ bq[:, sl].astype(np.float64).T
    )
  assert out.shape == (p, q) and out.dtype == jnp.float32
  assert rel_err(out, ref) < 1e-6, rel_err(out, ref)


def test_kernel_input_errors():
  a = jnp.zeros((4, 256), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="float8"):
    scaled_matmul_nt(a.astype(jnp.bfloat16), jnp.ones((4, 2)), a, jnp.ones((4, 2)))
  with pytest.raises(ValueError, match="sb must have shape"):
    scaled_matmul_nt(a, jnp.ones((4, 2)), a, jnp.ones((4, 3)))
  with pytest.raises(ValueError, match="power of two"):
    gemm_pallas.Tiles(bm=24)
  assert scaled_matmul_nt(a[:0], jnp.ones((0, 2)), a, jnp.ones((4, 2))).shape == (0, 4)


# --- linear through the kernel ---------------------------------------------------------------


@pytest.mark.parametrize("gfmt", ["e4m3", "e5m2"])
def test_linear_fprop_dgrad_wgrad_match_xla_path(xwd, gfmt):
  x, w, dy = xwd
  g = dataclasses.replace(BLOCK, grad_fmt=gfmt)
  prec = Precision("float32", fprop=g, dgrad=g, wgrad=g)  # float32 between operators
  with on_cpu():
    y0, vjp0 = jax.vjp(lambda a, b: linear(a, b, _xla(prec)), x, w)
    y1, vjp1 = jax.vjp(lambda a, b: linear(a, b, _interp(prec)), x, w)
    (dx0, dw0), (dx1, dw1) = vjp0(jnp.asarray(dy)), vjp1(jnp.asarray(dy))
  for got, want in ((y1, y0), (dx1, dx0), (dw1, dw0)):
    assert got.dtype == want.dtype == jnp.float32
    assert rel_err(got, want) < 2e-6, rel_err(got, want)


@pytest.fixture
def cpu_device():
  with on_cpu():
    yield


@pytest.mark.usefixtures("cpu_device")
def test_linear_k_multiple_of_block_bf16_and_grad_under_jit():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((2, 40, 256)), jnp.bfloat16)  # [..., K], 80 tokens
  w = jnp.asarray(rng.standard_normal((256, 136)) * 0.05, jnp.float32)
  jet = _xla(get_recipe("jet").train)

  def loss(a, b, p):
    return jnp.sum(linear(a, b, p).astype(jnp.float32) ** 2)

  y0, y1 = linear(x, w, jet), linear(x, w, _interp(jet))
  assert y1.dtype == jnp.bfloat16 and y1.shape == (2, 40, 136)
  # Same FP8 inputs; the float32 sums may differ in the last bits, so one bf16 rounding step.
  np.testing.assert_allclose(
    np.asarray(y1, np.float32), np.asarray(y0, np.float32), rtol=2**-7, atol=1e-6
  )
  g0 = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, jet)
  g1 = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, _interp(jet))
  assert g1[0].dtype == jnp.bfloat16 and g1[1].dtype == jnp.float32
  assert rel_err(g1[0].astype(jnp.float32), g0[0].astype(jnp.float32)) < 2**-7
  assert rel_err(g1[1], g0[1]) < 2**-7


@pytest.mark.usefixtures("cpu_device")
def test_per_tensor_scaling_and_non_finite_through_kernel(xwd):
  x, w, _ = xwd
  prec = _xla(dataclasses.replace(get_recipe("fp8_tensor").train, compute_dtype="float32"))
  assert rel_err(linear(x, w, _interp(prec)), linear(x, w, prec)) < 2e-6
  xn = x.copy()
  xn[3, 5] = np.nan
  y = np.asarray(linear(xn, w, _interp(get_recipe("jet").train)), np.float32)
  assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()


# --- selection -------------------------------------------------------------------------------


def test_backend_field_validation_and_resolution(monkeypatch):
  monkeypatch.delenv("JETRL_GEMM_BACKEND", raising=False)
  assert GEMM_BACKENDS == ("auto", "xla", "cublaslt", "pallas", "pallas_interpret")
  with pytest.raises(ValueError) as e:
    Fp8Gemm(gemm_backend="triton")
  assert all(name in str(e.value) for name in GEMM_BACKENDS)
  from jetrl.kernels import cublaslt

  on_hopper = ON_FP8_GPU and cublaslt.unavailable_reason() is None
  assert backend.resolve(Fp8Gemm()) == (
    "cublaslt" if on_hopper else "pallas" if ON_FP8_GPU else "xla"
  )
  if not on_hopper:  # an explicit request says why it cannot run
    with pytest.raises(ValueError, match="cublaslt"):
      backend.resolve(Fp8Gemm(gemm_backend="cublaslt"))
  with pytest.raises(ValueError, match="1x128"):  # cuBLASLt scales 128-blocks only
    backend.resolve(Fp8Gemm(block=64, gemm_backend="cublaslt"))
  assert backend.resolve(Fp8Gemm(gemm_backend="pallas_interpret")) == "pallas_interpret"
  # A block the kernel cannot tile: "auto" falls back to XLA, an explicit request is an error.
  assert backend.resolve(Fp8Gemm(block=96, gemm_backend="auto")) == "xla"
  with pytest.raises(ValueError, match="power of two"):
    backend.resolve(Fp8Gemm(block=96, gemm_backend="pallas"))
  # The kernel settings' gemm_backend says what "auto" resolves to; the field wins.
  dev = current_device(KernelConfig(gemm_backend="pallas_interpret"))
  assert backend.resolve(Fp8Gemm(), dev) == "pallas_interpret"
  assert backend.resolve(Fp8Gemm(gemm_backend="xla"), dev) == "xla"
  with pytest.raises(ValueError, match="JETRL_GEMM_BACKEND"):
    KernelConfig.from_env({"JETRL_GEMM_BACKEND": "cuda"})
  assert KernelConfig.from_env({"JETRL_GEMM_BACKEND": "pallas"}).gemm_backend == "pallas"


def test_with_gemm_backend_keeps_recipes_unified_and_hashable():
  for name in ("jet", "fp8_rollout", "bf16"):
    r = get_recipe(name)
    rp = with_gemm_backend(r, "pallas")
    assert rp.unified == r.unified and rp.name == r.name
    hash(rp.train), hash(rp.rollout)
    for gemm in (rp.train.fprop, rp.train.dgrad, rp.train.wgrad, rp.rollout.fprop):
      assert gemm is None or gemm.gemm_backend == "pallas"
  jet = with_gemm_backend(get_recipe("jet"), "xla")
  assert jet.rollout.fprop is jet.train.fprop  # the unified flow: one object
  assert with_gemm_backend(get_recipe("jet"), "auto") == get_recipe("jet")
  with pytest.raises(ValueError, match="pallas_interpret"):
    with_gemm_backend(get_recipe("jet"), "gpu")


# --- is it FP8 in the program? ---------------------------------------------------------------


def test_lowered_pallas_path_feeds_fp8_to_the_dot(xwd):
  x, w, _ = xwd
  jet = with_gemm_backend(get_recipe("jet").train, "pallas")
  xb = jnp.asarray(x, jnp.bfloat16)
  fwd = check_fp8_in_compiled(lambda a, b: linear(a, b, jet), xb, w, platform="cuda")
  assert fwd.ok, fwd.summary()
  assert fwd.stage == "lowered" or ON_FP8_GPU
  assert len(fwd.fp8_gemms) == 1 and not fwd.other_gemms
  # FP8 operands, and each K-block may be summed in the tensor cores (wgmma on Hopper) before
  # its float32 promotion.
  assert fwd.kernel_dots and all(
    d == "tt.dot(f8E4M3FN, f8E4M3FN) maxNumImpreciseAcc=128" for d in fwd.kernel_dots
  ), fwd.kernel_dots
  # Without fast accumulation the dot is a plain FP8 dot_general (Triton's mma.sync path).
  a, sa = quantize(xb, (1, 128))
  precise = check_fp8_in_compiled(
    lambda a_, s_: scaled_matmul_nt(a_, s_, a_, s_, tiles=gemm_pallas.Tiles(fast_accum=False)),
    a,
    sa,
    platform="cuda",
  )
  assert precise.ok and precise.kernel_dots == ("tt.dot(f8E4M3FN, f8E4M3FN)",), precise.kernel_dots
  # Training step: fprop (forward), dgrad and wgrad (backward) all in the FP8 kernel. The loss
  # needs y (a plain sum's gradient does not: compiled, the forward GEMM would be dead code).
  grad = jax.grad(lambda a, b: _square_sum(linear(a, b, jet)), argnums=(0, 1))
  bwd = check_fp8_in_compiled(grad, xb, w, platform="cuda", require_all=True)
  assert bwd.ok and len(bwd.fp8_gemms) == 3, bwd.summary()
  # E5M2 gradients: mixed-format dots are upcast to bf16 inside the kernel, and the check says so.
  e5 = with_gemm_backend(get_recipe("jet", grad_fmt="e5m2").train, "pallas")
  grad5 = jax.grad(lambda a, b: linear(a, b, e5).astype(jnp.float32).sum(), argnums=(0, 1))
  mixed = check_fp8_in_compiled(grad5, xb, w, platform="cuda")
  assert not mixed.ok and "tt.dot(bf16, bf16)" in mixed.kernel_dots


def test_a_kernel_without_a_dot_is_not_a_gemm(xwd):
  """The one-pass quantization kernel (no tt.dot) before the FP8 GEMM kernel: the check counts
  one GEMM, FP8, not a bf16 one (its input is bf16), lowered here and in the compiled
  program's op names (what `compiled_hlo_gemms` reads on a GPU)."""
  from jetrl.kernels import quant_kernel

  x, _, _ = xwd
  xb = jnp.asarray(x[:128, :256], jnp.bfloat16)

  def fn(a):
    ((q, s_t),) = quant_kernel.quantize_rows_cols(a, jnp.float8_e4m3fn, cols=False)
    return scaled_matmul_nt(q, s_t.T, q, s_t.T)

  res = check_fp8_in_compiled(fn, xb, platform="cuda", compile=False, require_all=True)
  assert res.ok and len(res.fp8_gemms) == 1 and not res.other_gemms, res.summary()
  alone = check_fp8_in_compiled(
    lambda a: quant_kernel.quantize_rows_cols(a, jnp.float8_e4m3fn), xb, platform="cuda"
  )
  assert not alone.fp8_gemms and not alone.other_gemms and not alone.ok
  line = (
    "  %pallas_call.12 = (f8e4m3fn[256,128]{1,0}, f32[1,256]{1,0}) custom-call(bf16[128,256]{1,0}"
    ' %a.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/transpose('
    'jvp(fp8_quantize_rows_cols))/pallas_call"}'
  )
  hlo = f"ENTRY %main (a.1: bf16[128,256]) -> f8e4m3fn[256,128] {{\n{line}\n}}\n"
  assert fp8_checks.compiled_hlo_gemms(hlo)[1]  # counted when nothing says it has no dot
  assert fp8_checks.compiled_hlo_gemms(hlo, {"fp8_quantize_rows_cols"}) == ([], [], [])


def test_check_catches_the_cpu_emulation_and_xla_upcasts(xwd):
  x, w, _ = xwd
  jet = _xla(get_recipe("jet").train)  # the CPU emulation (what "auto" runs without a GPU)
  emu = check_fp8_in_compiled(lambda a, b: linear(a, b, jet), x, w, platform="cpu")
  assert not emu.ok and not emu.fp8_gemms  # dequantize-then-float32-matmul
  xq, wq = quantize(x, (1, K))[0], quantize(w, (K, N))[0]
  dot = lambda a, b: jax.lax.dot_general(
    a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )
  lowered = check_fp8_in_compiled(dot, xq, wq, platform="cpu", compile=False)
  assert lowered.ok and lowered.stage == "lowered"
  if jax.default_backend() != "cpu":  # compiling is for the local platform only
    with pytest.raises(ValueError, match="cannot compile for 'cpu'"):
      check_fp8_in_compiled(dot, xq, wq, platform="cpu", compile=True)
    return
  # The CPU compiler converts the FP8 operands up before its dot: the compiled check fails.
  compiled = check_fp8_in_compiled(dot, xq, wq, platform="cpu", compile=True)
  assert compiled.stage == "compiled" and not compiled.ok and compiled.upcasts, compiled.summary()


@pytest.mark.skipif(
  not ON_FP8_GPU,
  reason="needs an FP8-capable NVIDIA GPU (compute capability "
  ">= 8.9) to compile the Triton kernel; its lowering is checked on CPU above",
)
def test_compiled_gpu_program_runs_fp8(xwd):
  x, w, dy = xwd
  jet = with_gemm_backend(get_recipe("jet").train, "pallas")
  xb = jnp.asarray(x, jnp.bfloat16)
  grad = jax.grad(lambda a, b: _square_sum(linear(a, b, jet)), argnums=(0, 1))
  res = check_fp8_in_compiled(grad, xb, w, require_all=True)
  assert res.stage == "compiled" and res.ok and len(res.fp8_gemms) == 3, res.summary()
  # The compiled kernel on partial tiles, with and without tensor-core accumulation per block.
  aq, sa = ref_quantize(x, (1, 128))
  bq, sb = ref_quantize(w.T, (1, 128))
  ref = sum(
    np.outer(sa[:, kb], sb[:, kb])
    * (
      aq[:, 128 * kb : 128 * kb + 128].astype(np.float64)
      @ bq[:, 128 * kb : 128 * kb + 128].astype(np.float64).T
    )
    for kb in range(sa.shape[1])
  )
  for fast in (True, False):
    out = jax.jit(
      lambda *a, f=fast: scaled_matmul_nt(
        *a, out_dtype=jnp.float32, tiles=gemm_pallas.Tiles(fast_accum=f)
      )
    )(aq, sa, bq, sb)
    assert rel_err(out, ref) < 1e-3, (fast, rel_err(out, ref))
  xla = with_gemm_backend(jet, "xla")
  for got, want in zip(
    jax.vjp(lambda a, b: linear(a, b, jet), xb, w)[1](jnp.asarray(dy, jnp.bfloat16)),
    jax.vjp(lambda a, b: linear(a, b, xla), xb, w)[1](jnp.asarray(dy, jnp.bfloat16)),
  ):
    assert rel_err(jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)) < 2**-7


GPU_HLO = """
HloModule jit_step, entry_computation_layout={(f8e4m3fn[256,512]{1,0})->bf16[256,256]{1,0}}

%fused_dot (param_0: f8e4m3fn[256,512], param_1: bf16[512,256]) -> bf16[256,256] {
  %param_0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %convert.1 = bf16[256,512]{1,0} convert(%param_0)
  %param_1 = bf16[512,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,256]{1,0} dot(%convert.1, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_convert_computation (param_0.1: f8e4m3fn[512,256]) -> bf16[512,256] {
  %param_0.1 = f8e4m3fn[512,256]{1,0} parameter(0)
  ROOT %convert.2 = bf16[512,256]{1,0} convert(%param_0.1)
}

%fused_plain (p0: bf16[256,512], p1: bf16[512,256]) -> bf16[256,256] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[512,256]{1,0} parameter(1)
  ROOT %dot.3 = bf16[256,256]{1,0} dot(bf16[256,512]{1,0} %p0, bf16[512,256]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[256,512], b: f8e4m3fn[256,512], w: f8e4m3fn[512,256], h: bf16[256,512]) -> bf16[256,256] {
  %a = f8e4m3fn[256,512]{1,0} parameter(0)
  %b = f8e4m3fn[256,512]{1,0} parameter(1)
  %w = f8e4m3fn[512,256]{1,0} parameter(2)
  %h = bf16[256,512]{1,0} parameter(3)
  %cublas-lt-matmul.1 = (bf16[256,256]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[256,512]{1,0} %a, f8e4m3fn[256,512]{1,0} %b, f32[] %s, f32[] %s), custom_call_target="__cublas$lt$matmul$f8"
  %wrapped_convert = bf16[512,256]{1,0} fusion(%w), kind=kLoop, calls=%wrapped_convert_computation
  %up = bf16[256,256]{1,0} fusion(%a, %wrapped_convert), kind=kCustom, calls=%fused_dot
  ROOT %plain = bf16[256,256]{1,0} fusion(%h, %wrapped_convert), kind=kCustom, calls=%fused_plain
}
"""


def test_ptx_scan(tmp_path):
  (tmp_path / "m.ptx").write_text(
    "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {...};\n"
    "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};\n"
    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {...};\n"
  )
  (tmp_path / "bf16_only.ptx").write_text("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32\n")
  assert fp8_checks.ptx_fp8_mma_lines(str(tmp_path)) == {"m.ptx": {"wgmma": 1, "mma.sync": 1}}


def test_compiled_hlo_parser_on_gpu_style_text():
  fp8, other, upcasts = fp8_checks.compiled_hlo_gemms(GPU_HLO)
  assert fp8 == ["custom-call __cublas$lt$matmul$f8(f8e4m3fn, f8e4m3fn, f32, f32)"]
  assert sorted(other) == ["dot(bf16, bf16)", "dot(bf16, bf16)"]
  # Both bf16 dots read an FP8 value converted up: one inside its fusion, one across fusions.
  assert len(upcasts) == 2


REGISTRATION_PROGRAM = """
import json
import jax.numpy as jnp
import jetrl.precision
from jax._src.pallas.triton import lowering as tl
from jetrl.kernels import gemm_pallas as gp

registered = lambda: gp._block_dot_p in tl.triton_lowering_rules
out = {"after_import": registered()}
a = jnp.ones((16, 32), jnp.float8_e4m3fn)
gp._block_dot(a, a, False, 32)  # the plain dot: no rule needed
out["after_plain_dot"] = registered()
y = gp._block_dot(a, a, True, 32)  # the kernel's fast-accumulation dot: registers it
out["after_fast_dot"] = registered()
out["reason"] = gp.fast_accum_unavailable()
out["value"] = float(y[0, 0])
print(json.dumps(out))
"""


def test_triton_rule_is_registered_on_first_use_not_on_import():
  """`import jetrl.precision` leaves JAX's Pallas Triton lowering rules alone; the kernel's
  first fast-accumulation dot registers its rule (in a fresh process: nothing imported yet)."""
  out = subprocess.run(
    [sys.executable, "-c", REGISTRATION_PROGRAM], capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["after_import"] is False and got["after_plain_dot"] is False
  # Registered unless this JAX's private Triton lowering could not be reached (then the reason).
  assert got["after_fast_dot"] is (got["reason"] is None), got
  assert got["value"] == 32.0  # a row of 32 ones . a row of 32 ones
