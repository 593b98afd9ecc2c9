"""The fused FP8 MLP (jetrl.precision.mlp), traced for a GPU and run here (interpret mode):
where it applies, its kernels in the program, and its output and gradients against the
unfused path and against a float64 MLP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import layers
from jetrl.precision import get_recipe, prequantize_weight
from jetrl.precision import mlp
from jetrl.precision import target as _target

M, D, F = 512, 256, 384
JET = get_recipe("jet").train


def _layer(rng):
  return {
    "w_gate": jnp.asarray(rng.normal(size=(D, F)) / 16, jnp.float32),
    "w_up": jnp.asarray(rng.normal(size=(D, F)) / 16, jnp.float32),
    "w_down": jnp.asarray(rng.normal(size=(F, D)) / 20, jnp.float32),
  }


class _Gpu:
  def __enter__(self):
    _target.push(_target.CompileTarget("gpu", interpret=True))

  def __exit__(self, *exc):
    _target.pop()
    mlp.set_fused_mlp(None)


@pytest.fixture(scope="module")
def runs():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, M // 2, D)), jnp.bfloat16)
  layer = _layer(rng)
  r = jnp.asarray(rng.normal(size=(2, M // 2, D)), jnp.float32)

  def loss(x, layer):
    y = layers.swiglu(x, layer, JET, jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) * r), y

  out = {}
  for fused in (True, False):
    with _Gpu():
      mlp.set_fused_mlp(fused)
      grad = lambda: jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
      jaxpr = str(jax.make_jaxpr(grad())(x, layer))
      (_, y), (dx, dw) = jax.jit(grad())(x, layer)
    out[fused] = (jaxpr, y, dx, dw)
  return (x, layer, r), out


def _reference(x, layer, r):
  """float64 MLP and its gradients of sum(y * r), from silu'(g) = sig (1 + g (1 - sig))."""
  X, R = np.asarray(x, np.float64).reshape(M, D), np.asarray(r, np.float64).reshape(M, D)
  Wg, Wu, Wd = (np.asarray(layer[k], np.float64) for k in ("w_gate", "w_up", "w_down"))
  G, U = X @ Wg, X @ Wu
  sig = 1 / (1 + np.exp(-G))
  H = G * sig * U
  dH = R @ Wd.T
  dG, dU = dH * U * sig * (1 + G * (1 - sig)), dH * G * sig
  grads = {"x": dG @ Wg.T + dU @ Wu.T, "w_gate": X.T @ dG, "w_up": X.T @ dU, "w_down": H.T @ R}
  return H @ Wd, grads


def test_the_program_holds_the_kernels_and_fewer_quantizations(runs):
  _, out = runs
  fused, plain = out[True][0], out[False][0]
  assert fused.count("name=fp8_swiglu_rows") == 1 and fused.count("name=fp8_swiglu_backward") == 1
  assert "fp8_swiglu" not in plain
  # one-pass kernels for x's rows, dy's cols and x's cols (dy's rows: `gemms.dgrad`, XLA's in a
  # program run here); SwiGLU's kernels write the rest, where the unfused path runs none here
  assert fused.count("name=fp8_quantize_rows_cols") == 3


def test_output_and_gradients_against_float64_and_the_unfused_path(runs):
  (x, layer, r), out = runs
  y_ref, g_ref = _reference(x, layer, r)
  (_, y1, dx1, dw1), (_, y2, dx2, dw2) = out[True], out[False]
  # the forward: the same FP8 groups as the unfused path (h rounded as jax.nn.silu rounds it)
  assert np.mean(np.asarray(y1) == np.asarray(y2)) > 0.99
  err = lambda a, ref: (
    np.linalg.norm(np.asarray(a, np.float64).reshape(ref.shape) - ref) / (np.linalg.norm(ref))
  )
  assert err(y1, y_ref) < 0.1
  fused = {"x": dx1, **dw1}
  plain = {"x": dx2, **dw2}
  for name, ref in g_ref.items():
    e1, e2 = err(fused[name], ref), err(plain[name], ref)
    # FP8 in every GEMM: a few percent from float64, as the unfused path
    assert e1 < 0.1 and e1 <= 1.02 * e2, (name, e1, e2)
    assert fused[name].dtype == plain[name].dtype
  # dup and h are the unfused path's values: up's and down's weight gradients agree to
  # float32 sums; dgate is rounded once instead of per operation (a few FP8 roundings move)
  for name in ("w_up", "w_down"):
    assert err(fused[name], np.asarray(plain[name], np.float64)) < 1e-5, name
  for name in ("x", "w_gate"):
    assert err(fused[name], np.asarray(plain[name], np.float64)) < 0.03, name


def test_where_it_applies():
  layer = _layer(np.random.default_rng(0))
  wg, wu, wd = layer["w_gate"], layer["w_up"], layer["w_down"]
  assert not mlp.applies(M, wg, wu, wd, JET)  # a CPU program: the XLA path
  with _Gpu():
    assert mlp.applies(M, wg, wu, wd, JET)
    assert not mlp.applies(256, wg, wu, wd, JET)  # a decode step's rows
    assert not mlp.applies(M + 64, wg, wu, wd, JET)  # rows off the 128-tile
    assert not mlp.applies(M, wg[:, :320], wu[:, :320], wd[:320], JET)  # F off the tile
    assert not mlp.applies(M, wg, wu, wd, get_recipe("bf16").train)
    assert not mlp.applies(M, wg, wu, wd, get_recipe("jet").rollout)  # no backward
    assert not mlp.applies(M, wg, wu, wd, get_recipe("jet_exact").train)  # batch-invariant
    frozen = prequantize_weight(wg, JET.fprop)
    assert not mlp.applies(M, frozen, wu, wd, JET)
    mlp.set_fused_mlp(False)
    assert not mlp.applies(M, wg, wu, wd, JET)


def test_a_bad_setting_is_refused(monkeypatch):
  monkeypatch.setenv("JETRL_FUSED_MLP", "yes")
  mlp._setting.cache_clear()
  try:
    with pytest.raises(ValueError, match="JETRL_FUSED_MLP must be 0, 1 or unset"):
      mlp.fused_mlp_enabled()
  finally:
    monkeypatch.delenv("JETRL_FUSED_MLP")
    mlp._setting.cache_clear()
