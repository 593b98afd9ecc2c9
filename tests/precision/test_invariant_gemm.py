"""The batch-invariant GEMMs (`jetrl.kernels.invariant_gemm`) in Pallas interpret mode: the FP8
forward GEMM against a float64 numpy evaluation of the blockwise formula, the bf16 GEMM against
float64, and each output row bit for bit the same whatever the other rows are and however many
there are (1, 7, 64, 130: one tile, a partial tile, whole tiles, padding)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_reference import ref_quantize
from jetrl.kernels import invariant_gemm as ig
from jetrl.precision import Fp8Gemm
from jetrl.precision.weights import quantize_2d

G = Fp8Gemm(scaling="block")  # jet_exact's fprop
K, N = 300, 200  # a partial K block and a partial column tile


def _x(rng, m, k=K):
  """Activations whose 1 x 128 groups span many binades (as real ones do)."""
  return (rng.standard_normal((m, k)) * np.exp(rng.uniform(-4, 3, (m, k)))).astype(np.float32)


@pytest.fixture(scope="module")
def weight():
  w = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32) * 0.05
  return w, quantize_2d(jnp.asarray(w), G, True), quantize_2d(jnp.asarray(w), G, False)


@pytest.fixture(scope="module")
def fprop(weight):
  _, wq, _ = weight
  return jax.jit(lambda x: ig.fp8_fprop(x, wq, G, jnp.float32, interpret=True))


def _ref_fp8(x, w, b=128):
  """sum_kb sx[:, kb] sw[kb, :] (xq[:, kb] @ wq[kb, :]) in float64 (docs/numerics.md)."""
  xq, sx = ref_quantize(x, (1, b))
  wq, sw = ref_quantize(w, (b, b))
  xq, wq = xq.astype(np.float64), wq.astype(np.float64)
  sw_cols = np.repeat(sw, b, axis=1)[:, : w.shape[1]].astype(np.float64)
  out = np.zeros((x.shape[0], w.shape[1]))
  for kb in range(sx.shape[1]):
    blk = slice(kb * b, (kb + 1) * b)
    out += (xq[:, blk] @ wq[blk]) * sx[:, kb].astype(np.float64)[:, None] * sw_cols[kb][None, :]
  return out


def test_fp8_gemm_matches_the_float64_blockwise_formula(weight, fprop):
  w, _, _ = weight
  x = _x(np.random.default_rng(0), 70)
  got = np.asarray(fprop(jnp.asarray(x)), np.float64)
  want = _ref_fp8(x, w)
  # float32 block dots, scales and sums: a few float32 roundings of the largest terms
  err = np.abs(got - want) / np.abs(want).max()
  assert err.max() < 2e-6, err.max()


def test_fp8_gemm_reads_either_weight_layout(weight):
  _, wk, wn = weight
  x = jnp.asarray(_x(np.random.default_rng(2), 9))
  f = lambda w: np.asarray(ig.fp8_fprop(x, w, G, jnp.bfloat16, interpret=True).astype(jnp.float32))
  np.testing.assert_array_equal(f(wk), f(wn))


def _rows_invariant(fn, make, rng):
  """Row i of fn's output: alone, among 6 others, among 63 others (twice, other rows
  redrawn), and among 129 (three row tiles, the last partial), at various positions."""
  base = make(rng, 130)
  want = np.asarray(fn(jnp.asarray(base[:64])))
  for m in (1, 7, 64, 130):
    for pos in sorted({0, m // 2, m - 1}):
      other = make(rng, m)
      for i in (0, 5, 63):
        other[pos] = base[i]
        got = np.asarray(fn(jnp.asarray(other)))
        np.testing.assert_array_equal(
          got[pos].view(np.uint32), want[i].view(np.uint32), err_msg=f"row {i} at {pos} of {m}"
        )


def test_fp8_gemm_row_depends_on_its_own_row_alone(fprop):
  _rows_invariant(fprop, _x, np.random.default_rng(3))


D, V = 200, 260


@pytest.fixture(scope="module")
def head():
  rng = np.random.default_rng(4)
  wv = (rng.standard_normal((V, D)) * 0.1).astype(ml_dtypes.bfloat16)
  return wv, jax.jit(lambda h: ig.matmul_nt(h, jnp.asarray(wv), interpret=True))


def _h(rng, m):
  return (rng.standard_normal((m, D)) * np.exp(rng.uniform(-2, 2, (m, 1)))).astype(
    ml_dtypes.bfloat16
  )


def test_bf16_gemm_matches_float64(head):
  wv, fn = head
  h = _h(np.random.default_rng(5), 40)
  got = np.asarray(fn(jnp.asarray(h)), np.float64)
  want = h.astype(np.float64) @ wv.astype(np.float64).T
  assert np.abs(got - want).max() / np.abs(want).max() < 1e-6


def test_bf16_gemm_row_depends_on_its_own_row_alone(head):
  _, fn = head
  _rows_invariant(fn, _h, np.random.default_rng(6))


def _kernel_signature(fn, m: int, k: int):
  """(kernel body, block shapes, compiler settings) of the one pallas_call fn traces for m rows."""
  jaxpr = jax.make_jaxpr(fn)(jnp.zeros((m, k), jnp.bfloat16)).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  blocks = [str(b.block_shape) for b in eqn.params["grid_mapping"].block_mappings]
  return str(eqn.params["jaxpr"]), tuple(blocks), str(eqn.params["compiler_params"])


def test_one_program_for_every_row_count(weight, head):
  """The tile each program computes, its body and its Triton settings do not depend on M
  (on a GPU that is what makes a row's arithmetic the same: interpret mode cannot show it,
  since XLA's CPU dot of any tile is row-invariant); only the grid's length does."""
  _, wq, _ = weight
  wv, _ = head
  fp8 = lambda x: ig.fp8_fprop(x, wq, G, jnp.bfloat16, interpret=False)
  bf16 = lambda h: ig.matmul_nt(h, jnp.asarray(wv), interpret=False)
  for fn, k in ((fp8, K), (bf16, D)):
    sigs = {m: _kernel_signature(fn, m, k) for m in (1, 7, 64, 130, 4096)}
    assert len(set(sigs.values())) == 1, sigs


def test_bf16_gemm_rejects_mixed_dtypes():
  with pytest.raises(ValueError, match="16-bit"):
    ig.matmul_nt(jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((3, 4), jnp.float32), interpret=True)


def test_rms_norm_row_alone_and_against_float64():
  """The invariant RMSNorm (kernels.invariant_norm: one program a row, a fixed-order float32
  sum): within bf16 rounding of float64, and each row bit for bit the same alone as among 9."""
  from jetrl.kernels import invariant_norm as inorm  # noqa: PLC0415
  from jetrl.kernels.norm_kernel import rms_norm_cd  # noqa: PLC0415

  d, eps = 384, 1e-6  # three chunks of 128
  rng = np.random.default_rng(5)
  x = _x(rng, 9, d).astype(ml_dtypes.bfloat16)
  w = (1 + 0.1 * rng.standard_normal(d)).astype(ml_dtypes.bfloat16)
  f = jax.jit(
    lambda a: inorm.rms_norm(a, w, eps, jnp.bfloat16, interpret=True, reference=rms_norm_cd)
  )
  got = np.asarray(f(x), np.float64)
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
  assert np.all(np.abs(got - want) <= 2**-7 * np.abs(want) + 1e-30)
  for r in (0, 8):
    np.testing.assert_array_equal(np.asarray(f(x[r : r + 1]), np.float64)[0], got[r])
