"""FP8 `linear`: forward, FP8 backward, batch invariance, traced float8, transformations."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import ref_fake, to_bf16
from jetrl.precision import Fp8Gemm, Precision, get_recipe, linear, quantize

BLOCK = Fp8Gemm()
# The jet recipe's FP8 GEMMs with float32 between operators: isolates FP8 from bf16 rounding.
JET32 = Precision("float32", fprop=BLOCK, dgrad=BLOCK, wgrad=BLOCK)
JET32_E5M2 = Precision(
  "float32",
  fprop=BLOCK,
  dgrad=dataclasses.replace(BLOCK, grad_fmt="e5m2"),
  wgrad=dataclasses.replace(BLOCK, grad_fmt="e5m2"),
)
M, K, N = 130, 300, 200  # partial token groups, partial K and N blocks
# On a GPU `linear`'s FP8 GEMMs run where "auto" sends them (cuBLASLt or the Pallas kernel),
# whose tensor cores sum each 128-product block at their own reduced precision before the
# float32 promotion: docs/numerics.md ("The GPU GEMMs and their tolerance") bounds the result
# at 1e-3 of the output's largest magnitude. On the CPU the XLA path sums in float32, and the
# tighter tolerances below hold.
ON_GPU = jax.default_backend() == "gpu"
GPU_TOL = 1e-3


@pytest.fixture(scope="module")
def xwd():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
  dy = (rng.standard_normal((M, N)) * 1e-3).astype(np.float32)
  return x, w, dy


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


def test_forward_matches_dequantize_then_matmul_float64(xwd):
  x, w, _ = xwd
  y = jax.jit(lambda a, b: linear(a, b, JET32))(x, w)
  ref = ref_fake(x, (1, 128)) @ ref_fake(w, (128, 128))
  assert y.dtype == jnp.float32
  tol = GPU_TOL if ON_GPU else 3e-6
  assert rel_err(y, ref) < tol, rel_err(y, ref)
  # bf16 compute dtype: inputs are bf16 between operators, output rounded to bf16.
  yb = jax.jit(lambda a, b: linear(a, b, get_recipe("jet").train))(x, w)
  refb = ref_fake(to_bf16(x), (1, 128)) @ ref_fake(w, (128, 128))
  assert yb.dtype == jnp.bfloat16
  atol = (GPU_TOL if ON_GPU else 2**-8 * 1e-2) * np.abs(refb).max()
  np.testing.assert_allclose(np.asarray(yb, np.float64), refb, rtol=2**-8, atol=atol)
  # And it is really FP8: far from the unquantized product.
  assert rel_err(y, x.astype(np.float64) @ w) > 1e-3


@pytest.mark.parametrize("prec,gfmt", [(JET32, "e4m3"), (JET32_E5M2, "e5m2")])
def test_backward_matches_spec_reference(xwd, prec, gfmt):
  x, w, dy = xwd
  _, vjp = jax.vjp(lambda a, b: linear(a, b, prec), x, w)
  dx, dw = jax.jit(vjp)(jnp.asarray(dy))
  dx_ref = ref_fake(dy, (1, 128), gfmt) @ ref_fake(w, (128, 128)).T
  dw_ref = ref_fake(x, (128, 1)).T @ ref_fake(dy, (128, 1), gfmt)
  tol = GPU_TOL if ON_GPU else 3e-6
  assert rel_err(dx, dx_ref) < tol, rel_err(dx, dx_ref)
  assert rel_err(dw, dw_ref) < tol, rel_err(dw, dw_ref)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32


def test_backward_bf16_between_operators(xwd):
  x, w, dy = xwd
  xb = jnp.asarray(x, jnp.bfloat16)
  _, vjp = jax.vjp(lambda a, b: linear(a, b, get_recipe("jet").train), xb, w)
  dx, dw = vjp(jnp.asarray(dy, jnp.bfloat16))
  assert dx.dtype == jnp.bfloat16, "gradients flow between operators in bf16"
  assert dw.dtype == jnp.float32, "weight gradients come back in the master weights' dtype"
  dx_ref = ref_fake(to_bf16(dy), (1, 128)) @ ref_fake(w, (128, 128)).T
  np.testing.assert_allclose(
    np.asarray(dx, np.float64), dx_ref, rtol=2**-7, atol=1e-3 * np.abs(dx_ref).max()
  )


def _mlp_loss(params, x, t, prec):
  h = jax.nn.gelu(linear(x, params["w1"], prec))
  y = linear(h, params["w2"], prec).astype(jnp.float32)
  return jnp.mean((y - t) ** 2)


def test_jet_mlp_gradient_close_to_bf16():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((256, 256)).astype(np.float32)
  t = rng.standard_normal((256, 256)).astype(np.float32)
  params = {
    "w1": (rng.standard_normal((256, 512)) / 16).astype(np.float32),
    "w2": (rng.standard_normal((512, 256)) / 22).astype(np.float32),
  }
  g = {
    r: jax.jit(jax.grad(_mlp_loss), static_argnums=3)(params, x, t, get_recipe(r).train)
    for r in ("bf16", "jet", "fp32")
  }
  for name in ("w1", "w2"):
    ref = np.asarray(g["fp32"][name], np.float64)
    e_bf16 = np.linalg.norm(np.asarray(g["bf16"][name]) - ref) / np.linalg.norm(ref)
    e_jet = np.linalg.norm(
      np.asarray(g["jet"][name]) - np.asarray(g["bf16"][name])
    ) / np.linalg.norm(ref)
    # E4M3 rounding is ~2.7% RMS per operand, so one FP8 GEMM is ~3.8% off in relative norm;
    # w1's gradient passes through two (layer 2 dgrad, layer 1 wgrad): ~5-6% is expected.
    assert e_jet < 0.08, (
      f"{name}: jet vs bf16 gradient relative error {e_jet:.4f} (bf16 vs fp32: {e_bf16:.4f})"
    )
    assert e_jet > e_bf16, "FP8 gradients must differ from bf16 more than bf16 from fp32"


@pytest.mark.parametrize("recipe", ["jet", "fp8_rollout"])
def test_batch_invariance_blockwise(recipe):
  rng = np.random.default_rng(4)
  batch = rng.standard_normal((1025, 384)).astype(np.float32) * np.exp(
    rng.standard_normal((1025, 1))
  )
  w = (rng.standard_normal((384, 256)) * 0.05).astype(np.float32)
  row = batch[7:8]
  prec = get_recipe(recipe).rollout
  block = (1, prec.fprop.block)
  q1, s1 = quantize(row, block)
  qb, sb = quantize(batch, block)
  np.testing.assert_array_equal(np.asarray(q1).view(np.uint8), np.asarray(qb)[7:8].view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s1), np.asarray(sb)[7:8])
  # linear: same FP8 inputs; the matmul itself may differ in the last float32 bits. On a GPU
  # the kernel's algorithm, and with it the order and precision of its block sums, may depend
  # on the number of rows (docs/numerics.md: the engine floor), within the GPU tolerance.
  p32 = dataclasses.replace(prec, compute_dtype="float32")
  y1 = linear(row, w, p32)
  yb = linear(batch, w, p32)[7:8]
  atol = (GPU_TOL if ON_GPU else 1e-6) * np.abs(np.asarray(yb)).max()
  np.testing.assert_allclose(np.asarray(y1), np.asarray(yb), rtol=1e-5, atol=atol)


def test_per_tensor_scaling_is_batch_dependent():
  rng = np.random.default_rng(5)
  batch = rng.standard_normal((1025, 384)).astype(np.float32)
  batch[100] *= 50.0  # one outlier token sets the tensor's scale for everyone
  row = batch[7:8]
  q1, s1 = quantize(row, row.shape)
  qb, sb = quantize(batch, batch.shape)
  # Expected difference: fp8_tensor's scale is max|x| over the whole batch, so the same token
  # is quantized differently alone and inside a batch. This is why it is only a baseline.
  assert float(s1[0, 0]) != float(sb[0, 0])
  assert (np.asarray(q1).view(np.uint8) != np.asarray(qb)[7:8].view(np.uint8)).any()


def test_traced_program_contains_float8_forward_and_backward(xwd):
  x, w, dy = xwd
  prec = get_recipe("jet", grad_fmt="e5m2").train
  fwd = str(jax.make_jaxpr(lambda a, b: linear(a, b, prec))(x, w))
  assert "f8_e4m3fn" in fwd
  assert "f8_e5m2" not in fwd
  grad = str(
    jax.make_jaxpr(
      jax.grad(lambda a, b: linear(a, b, prec).astype(jnp.float32).sum(), argnums=(0, 1))
    )(x, w)
  )
  # e5m2 is the gradient format: it appears only if dy is really quantized in the backward.
  assert "f8_e5m2" in grad
  # wgrad quantizes x in 128x1 groups (e4m3) inside the backward as well.
  assert grad.count("f8_e4m3fn") > fwd.count("f8_e4m3fn")
  plain = str(
    jax.make_jaxpr(
      jax.grad(lambda a, b: linear(a, b, get_recipe("bf16").train).astype(jnp.float32).sum())
    )(x, w)
  )
  assert "f8" not in plain


def test_jit_vmap_grad_compose(xwd):
  x, w, _ = xwd
  prec = get_recipe("jet").train
  xs = np.stack([x[:64], x[64:128]])  # [2, 64, K]
  f = lambda a, b: linear(a, b, prec).astype(jnp.float32).sum()
  v = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None)))(xs, w)
  for i in range(2):
    gx, gw = jax.grad(f, argnums=(0, 1))(xs[i], w)
    np.testing.assert_array_equal(np.asarray(v[0][i]), np.asarray(gx))
    # Batched and unbatched float32 dots may sum in different orders: float32 rounding.
    np.testing.assert_allclose(
      np.asarray(v[1][i]), np.asarray(gw), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(gw)).max()
    )
  # Leading batch dims: [..., K] flattens to tokens.
  y3 = linear(xs, w, prec)
  np.testing.assert_array_equal(
    np.asarray(y3).reshape(128, N), np.asarray(linear(x[:128], w, prec))
  )


def test_shape_errors():
  with pytest.raises(ValueError, match="share K"):
    linear(jnp.ones((2, 3)), jnp.ones((4, 5)), get_recipe("jet").train)
  with pytest.raises(ValueError, match="2-D"):
    linear(jnp.ones((2, 3)), jnp.ones((3, 4, 5)), None)
  with pytest.raises(TypeError, match="Precision"):
    linear(jnp.ones((2, 3)), jnp.ones((3, 4)), "jet")


def test_prequantized_weight_gives_identical_forward(xwd):
  from jetrl.precision import QuantizedWeight, prequantize_weight

  x, w, _ = xwd
  for name in ("jet", "fp8_rollout", "fp8_tensor"):
    prec = get_recipe(name).rollout
    qw = prequantize_weight(w, prec.fprop)
    assert isinstance(qw, QuantizedWeight) and qw.q.dtype == jnp.float8_e4m3fn
    a = np.asarray(jax.jit(lambda x_, w_: linear(x_, w_, prec))(x, w))
    b = np.asarray(jax.jit(lambda x_, q_: linear(x_, q_, prec))(x, qw))
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
  stacked = prequantize_weight(np.stack([w, 2 * w]), get_recipe("jet").rollout.fprop)
  assert stacked.q.shape == (2, K, N) and stacked.scale.shape == (2, 3, 2)
  with pytest.raises(ValueError, match="FP8 fprop"):
    linear(x, qw, get_recipe("bf16").rollout)
