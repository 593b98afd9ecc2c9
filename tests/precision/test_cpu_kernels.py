"""jet_exact's CPU kernels (`jetrl.kernels.cpu_kernels`): the exact FP8 GEMM against the numpy
float64 blockwise reference and the XLA path, bit for bit, on every kind of tail and both
threading splits; the exact dot against integer references in numpy; the model's exact forward
with and without the kernels; clear errors; the kernel really in the compiled program."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_reference import ref_exact_gemm, to_bf16
from jetrl.kernels import KernelConfig, cpu_kernels, current_device, ffi_build, linear
from jetrl.kernels import resolve_plan
from jetrl.precision import get_recipe, quantize_weight
from jetrl.kernels.exact_gemm import fp8_fprop

G = get_recipe("jet_exact").train.fprop

pytestmark = [
  pytest.mark.skipif(ffi_build.compiler() is None, reason="no C++ compiler"),
  # The kernels are registered for XLA's CPU platform and used only where JAX's backend is the
  # CPU (cpu_kernels.usable): on a GPU jet_exact's exact sums are XLA's, and test_exact.py
  # checks them there.
  pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="jet_exact's CPU kernels serve CPU processes only"
  ),
]


def test_the_kernels_build_and_pass_their_self_check():
  # With a compiler present, a kernel that does not build or disagrees with the XLA path is a
  # failure here, not a silent fallback.
  assert cpu_kernels.unavailable_reason() is None
  assert cpu_kernels.usable(current_device())


def _bits(a):
  return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize(
  "m,k,n",
  [
    (1, 128, 32),  # one row, one block, one column strip
    (7, 300, 161),  # partial K block, N not a multiple of 32 or 128
    (33, 256, 1000),  # few rows: split by column strips
    (260, 129, 77),  # many rows: split by row groups; a K block of one element
  ],
)
def test_exact_fp8_gemm_equals_the_reference_and_the_xla_path(m, k, n):
  rng = np.random.default_rng(m + k + n)
  x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(2 * rng.standard_normal((m, 1)))
  x[0, : min(k, 128)] *= 1e-5  # a block far below the row's others
  w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
  x = to_bf16(x)
  q, s, _ = quantize_weight(jnp.asarray(w), G)
  f = lambda kernel: jax.jit(lambda a: fp8_fprop(a, q, s, G, kernel=kernel))
  got = f(True)(jnp.asarray(x, jnp.bfloat16))
  np.testing.assert_array_equal(_bits(got), ref_exact_gemm(x, w).view(np.uint32))
  np.testing.assert_array_equal(_bits(got), _bits(f(False)(jnp.asarray(x, jnp.bfloat16))))


def _int_operands(rng, t, m, k, n, a_dtype, b_dtype, a_bits=20, b_bits=7):
  """Integer-valued operands whose dot is exact in float64, and numpy's float64 reference."""
  a = rng.integers(-(2**a_bits), 2**a_bits, (t, m, k)).astype(np.float64)
  b = rng.integers(-(2**b_bits), 2**b_bits, (t, k, n)).astype(np.float64)
  # Spread the terms over many binades (still exact: < 2^53 in all).
  a *= 2.0 ** rng.integers(-30, 0, (t, m, 1))
  want = np.einsum("tmk,tkn->tmn", a, b)
  return a.astype(a_dtype), b.astype(b_dtype), want


@pytest.mark.parametrize("b_nk", [False, True])
@pytest.mark.parametrize("t,m,k,n", [(1, 32, 256, 2048), (64, 2, 192, 64), (3, 5, 300, 37)])
def test_exact_dot_equals_the_integer_reference(b_nk, t, m, k, n):
  rng = np.random.default_rng(t * m + k + n + b_nk)
  for a_dtype, b_dtype in ((np.float64, ml_dtypes.bfloat16), (np.float32, np.float32)):
    a, b, want = _int_operands(
      rng, t, m, k, n, a_dtype, b_dtype, a_bits=20 if a_dtype == np.float64 else 16
    )
    if b_nk:
      b = np.ascontiguousarray(np.swapaxes(b, 1, 2))
    with jax.enable_x64(True):
      got = jax.jit(lambda a, b: cpu_kernels.exact_dot(a, b, b_nk=b_nk))(a, b)
      got = np.asarray(got)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


def test_exact_dot_rejects_bad_operands():
  a = jnp.zeros((2, 3, 4), jnp.float32)
  with pytest.raises(ValueError, match="must be 3-D"):
    cpu_kernels.exact_dot(a[0], jnp.zeros((4, 5), jnp.bfloat16), b_nk=False)
  with pytest.raises(ValueError, match="bfloat16 or float32"):
    cpu_kernels.exact_dot(a, jnp.zeros((2, 4, 5), jnp.int8), b_nk=False)
  with pytest.raises(ValueError, match="do not share T and K"):
    cpu_kernels.exact_dot(a, jnp.zeros((2, 5, 5), jnp.bfloat16), b_nk=False)


def test_the_compiled_programs_call_the_kernels():
  from jetrl.kernels import linear

  x = jnp.ones((4, 256), jnp.bfloat16)
  w = jnp.ones((256, 64), jnp.float32)
  text = (
    jax.jit(lambda a, b: linear(a, b, get_recipe("jet_exact").rollout))
    .lower(x, w)
    .compile()
    .as_text()
  )
  assert cpu_kernels.TARGET in text
  q, s, _ = quantize_weight(w, G)
  text = jax.jit(lambda a: fp8_fprop(a, q, s, G, kernel=False)).lower(x).compile().as_text()
  assert cpu_kernels.TARGET not in text


def test_disabled_by_the_kernel_settings():
  """`KernelConfig(exact_cpu_kernel=False)` (JETRL_EXACT_CPU_KERNEL=0 where none is given)
  keeps the XLA path: the exact forward GEMM of a plan resolved with it calls no kernel."""
  off = KernelConfig(exact_cpu_kernel=False)
  assert KernelConfig.from_env({"JETRL_EXACT_CPU_KERNEL": "0"}) == off
  assert cpu_kernels.unavailable_reason() is None and cpu_kernels.usable(current_device())
  assert not cpu_kernels.usable(current_device(off))
  x = jnp.ones((4, 256), jnp.float32)
  w = jnp.ones((256, 128), jnp.float32)
  exact = get_recipe("jet_exact").train
  text = lambda plan: jax.jit(lambda a: linear(a, w, exact, plan)).lower(x).compile().as_text()
  assert cpu_kernels.TARGET in text(resolve_plan(exact))
  assert cpu_kernels.TARGET not in text(resolve_plan(exact, off))


def test_the_model_with_and_without_the_kernels(monkeypatch):
  """jet_exact's sampler and training forward on a tiny random model (untied and tied LM
  head): the same tokens and log-probs bit for bit whether the kernels or XLA compute the
  exact sums, and the sampler's log-probs equal the training forward's."""
  import dataclasses

  from jetrl import models as M
  from jetrl.models import token_logprobs
  from jetrl.sampling import SamplingConfig, sample

  exact = get_recipe("jet_exact")
  sc = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, prompt_len=8)
  prompts = [[1, 5, 9], [2, 7, 4, 4, 8], [3], [6, 6, 2, 1]]

  def run(cfg, params):
    out = sample(params, cfg, prompts, jax.random.PRNGKey(3), sc, exact.rollout)
    out = jax.tree_util.tree_map(np.asarray, out)
    seq = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    lp, _ = jax.jit(
      lambda p, *a: token_logprobs(
        p, cfg, a[0], a[1], precision=exact.train, positions=a[2], attention_mask=a[3]
      )
    )(params, seq[:, :-1], seq[:, 1:], pos[:, :-1], mask[:, :-1])
    return out, np.asarray(lp)[:, -out.tokens.shape[1] :]

  for tied in (False, True):
    cfg = dataclasses.replace(
      M.get_config("tiny"), vocab_size=64, max_seq_len=32, tie_embeddings=tied, n_layers=1
    )
    params = jax.tree_util.tree_map(
      lambda a: a * 3.0 if a.ndim >= 2 else a, M.init_params(cfg, jax.random.PRNGKey(1))
    )
    jax.clear_caches()
    with_kernels = run(cfg, params)
    monkeypatch.setattr(cpu_kernels, "usable", lambda dev=None: False)
    jax.clear_caches()  # the sampler's jitted steps were traced with the kernels
    without = run(cfg, params)
    monkeypatch.undo()
    jax.clear_caches()
    (a, lp_a), (b, lp_b) = with_kernels, without
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs.view(np.uint32), b.logprobs.view(np.uint32))
    np.testing.assert_array_equal(lp_a.view(np.uint32), lp_b.view(np.uint32))
    assert a.mask.sum() > 40
    assert np.abs(lp_a - a.logprobs)[a.mask].max() == 0.0


def test_the_portable_code_path_gives_the_same_bits(tmp_path):
  """Built without AVX-512 (plain C++ loops instead of the intrinsics), the kernels pass the
  same bit-for-bit self-check: machines without AVX-512 get the same numbers."""
  import os
  import shutil
  import subprocess
  import sys

  code = (
    "from jetrl.kernels import cpu_kernels as c\n"
    "c.FLAGS = ('-O2', '-march=x86-64-v2', '-ffp-contract=off')\n"
    "print('REASON', c.unavailable_reason())\n"
  )
  env = dict(os.environ, JETRL_CACHE_DIR=str(tmp_path))
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
  )
  if "unrecognized" in proc.stderr or "x86-64-v2" in proc.stdout + proc.stderr:
    pytest.skip("the compiler does not know -march=x86-64-v2 (not x86?)")
  assert "REASON None" in proc.stdout, proc.stdout + proc.stderr[-3000:]
  (lib,) = (tmp_path / "ffi").glob("libexact_cpu-*.so")
  if shutil.which("objdump"):  # no AVX-512 / FMA instructions in this build
    text = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "zmm" not in text and "vfmadd" not in text
