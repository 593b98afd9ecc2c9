"""SwiGLU's forward and backward kernels (Pallas interpret mode here): their bf16 values against
float64, and every FP8 group they write against `quantize` of that value, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.precision import quantize
from jetrl.kernels import swiglu_kernel as sk

BF16, E4M3, E5M2 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2
M, F = 256, 384
ULP = 2.0**-8  # bf16's unit roundoff (8 significant bits)


def _bits(a):
  return np.asarray(a).view(np.uint8 if np.dtype(a.dtype).itemsize == 1 else np.uint16)


def _same(a, b):
  np.testing.assert_array_equal(_bits(a), _bits(b))


def _inputs():
  rng = np.random.default_rng(7)
  g = rng.normal(size=(M, F)) * 3
  g[0, :5] = [0.0, -1.2785, 40.0, -40.0, 1e-3]  # zero, silu's minimum, saturated sigmoids
  u = rng.normal(size=(M, F)) * np.exp(rng.normal(size=(M, 1)))
  dh = rng.normal(size=(M, F)) * np.exp(2 * rng.normal(size=(1, F)))
  dh[:128, 128:256] = 0.0  # a tile whose gradient is zero: every group's scale is 1
  return tuple(jnp.asarray(a, BF16) for a in (g, u, dh))


def _run(interpret: bool):
  g, u, dh = _inputs()
  fwd = jax.jit(lambda a, b: sk.swiglu_rows(a, b, BF16, E4M3, interpret=interpret, values=True))
  bwd = jax.jit(
    lambda a, b, c: sk.swiglu_backward(
      a, b, c, BF16, E4M3, E4M3, E5M2, interpret=interpret, values=True
    )
  )
  return (g, u, dh), fwd(g, u), bwd(g, u, dh)


@pytest.fixture(scope="module")
def runs():
  return _run(interpret=True)


def _f64(a):
  return np.asarray(a, np.float64)


def test_the_values_are_swiglu_and_its_derivative_in_float64(runs):
  _check_values(runs)


def _check_values(runs):
  (g, u, dh), (_, _, h), (*_, (h2, dg, du)) = runs
  G, U, D = _f64(g), _f64(u), _f64(dh)
  sig = 1.0 / (1.0 + np.exp(-G))
  # silu'(g) = sig (1 + g (1 - sig)), checked here by a central difference in float64
  eps = 1e-6
  silu = lambda z: z / (1.0 + np.exp(-z))
  np.testing.assert_allclose(
    sig * (1 + G * (1 - sig)), (silu(G + eps) - silu(G - eps)) / (2 * eps), atol=1e-7
  )
  H, DU, DG = G * sig * U, D * G * sig, D * U * sig * (1 + G * (1 - sig))
  # five roundings to bf16 (exp, 1 +, 1 /, g * sig, the product), each within one unit
  assert np.all(np.abs(_f64(h) - H) <= 5.5 * ULP * np.abs(H))
  assert np.all(np.abs(_f64(du) - DU) <= 5.5 * ULP * np.abs(DU))
  # dg from the forward's bf16 sigmoid (three roundings), whose error the derivative scales
  # by up to 1 + 2 |g|, where 1 + g (1 - sig) itself cancels near silu's minimum (g = -1.28)
  bound = 3.5 * ULP * np.abs(D * U) * (1 + 2 * np.abs(G)) + 1.5 * ULP * np.abs(DG)
  assert np.all(np.abs(_f64(dg) - DG) <= bound)
  _same(h2, h)  # down's wgrad reads the h its fprop read


def test_every_group_is_quantize_of_its_value(runs):
  _check_groups(runs)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Triton kernels")
def test_the_compiled_kernels_compute_and_quantize_as_interpreted():
  """On a GPU: the kernels compiled, not interpreted. The same bounds against float64, and
  every FP8 group `quantize`'s of the bf16 value the kernel computed."""
  runs = _run(interpret=False)
  _check_values(runs)
  _check_groups(runs)


def _check_groups(runs):
  _, (q, s_t, h), (h_c, dg_r, dg_c, du_r, du_c, (h2, dg, du)) = runs
  want_q, want_s = quantize(h, (1, 128), E4M3)
  _same(q, want_q)
  np.testing.assert_array_equal(np.asarray(s_t).T, np.asarray(want_s))

  def rows(pair, v, fmt):
    wq, ws = quantize(v, (1, 128), fmt)
    _same(pair[0], wq)
    np.testing.assert_array_equal(np.asarray(pair[1]).T, np.asarray(ws))

  def cols(pair, v, fmt):  # 128 x 1 groups of v are 1 x 128 groups of v^T
    wq, ws = quantize(v.T, (1, 128), fmt)
    _same(pair[0], wq)
    np.testing.assert_array_equal(np.asarray(pair[1]).T, np.asarray(ws))

  cols(h_c, h2, E4M3)
  rows(dg_r, dg, E4M3)
  cols(dg_c, dg, E5M2)
  rows(du_r, du, E4M3)
  cols(du_c, du, E5M2)
  assert h_c[0].dtype == E4M3 and dg_c[0].dtype == E5M2 and dg_r[0].dtype == E4M3
  assert h_c[0].shape == (F, M) and h_c[1].shape == (M // 128, F)
  assert dg_r[0].shape == (M, F) and dg_r[1].shape == (F // 128, M)
  # the zero tile: scale 1, values 0, in both layouts
  assert np.all(np.asarray(dg_r[1])[1, :128] == 1.0) and np.all(
    np.asarray(du_c[1])[0, 128:256] == 1.0
  )


def test_shapes_off_the_tile_are_refused():
  a = jnp.zeros((200, 256), BF16)
  with pytest.raises(ValueError, match="multiples of 128"):
    sk.swiglu_rows(a, a, BF16, E4M3, interpret=True)
  with pytest.raises(ValueError, match="one shape"):
    sk.swiglu_backward(jnp.zeros((256, 256), BF16), a, a, BF16, E4M3, E4M3, E4M3, interpret=True)


@pytest.mark.parametrize(
  "interpret",
  [True, pytest.param(False, marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                        reason="compiles the Triton kernels"))],
)  # fmt: skip
def test_the_fused_gate_up_kernel_is_the_split_kernels(interpret):
  """`swiglu_gate_up_rows` (a rollout's fused gate / up output, 128 rows a program) gives the
  values and groups `swiglu_rows` gives for the two halves, and each group is `quantize`'s."""
  rng = np.random.default_rng(5)
  gu = jnp.asarray(2 * rng.normal(size=(256, 2 * 384)), BF16)
  q, s_t, h = sk.swiglu_gate_up_rows(gu, BF16, E4M3, interpret=interpret, values=True)
  gate, up = jnp.split(gu, 2, axis=-1)
  want_q, want_s_t, want_h = sk.swiglu_rows(gate, up, BF16, E4M3, interpret=interpret, values=True)
  _same(h, want_h)
  _same(q, want_q)
  np.testing.assert_array_equal(np.asarray(s_t), np.asarray(want_s_t))
  wq, ws = quantize(h, (1, 128), E4M3)
  _same(q, wq)
  with pytest.raises(ValueError, match="rows a multiple of 128"):
    sk.swiglu_gate_up_rows(gu[:100], BF16, E4M3, interpret=True)
