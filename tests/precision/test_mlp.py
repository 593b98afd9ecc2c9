"""The fused FP8 MLP (jetrl.kernels.mlp), traced for a GPU and run here (interpret mode):
where it applies, its kernels in the program, and its output and gradients against the
unfused path and against a float64 MLP."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.models import layers
from jetrl.precision import get_recipe, prequantize_weight
from jetrl.kernels import Device, KernelConfig, current_device, mlp, resolve_plan

M, D, F = 512, 256, 384
JET = get_recipe("jet").train


def _layer(rng):
  return {
    "w_gate": jnp.asarray(rng.normal(size=(D, F)) / 16, jnp.float32),
    "w_up": jnp.asarray(rng.normal(size=(D, F)) / 16, jnp.float32),
    "w_down": jnp.asarray(rng.normal(size=(F, D)) / 20, jnp.float32),
  }


GPU = Device("gpu", interpret=True)  # a GPU program run here, its kernels interpreted


def _plan(precision, fused: bool = True):
  """The plan for `precision` on GPU, the fused MLP on or off."""
  return resolve_plan(precision, dataclasses.replace(GPU, kernels=KernelConfig(fused_mlp=fused)))


@pytest.fixture(scope="module")
def runs():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, M // 2, D)), jnp.bfloat16)
  layer = _layer(rng)
  r = jnp.asarray(rng.normal(size=(2, M // 2, D)), jnp.float32)

  def loss(x, layer, plan):
    y = layers.swiglu(x, layer, plan, jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) * r), y

  out = {}
  for fused in (True, False):
    plan = _plan(JET, fused)
    grad = lambda: jax.value_and_grad(lambda a, b: loss(a, b, plan), argnums=(0, 1), has_aux=True)
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
  # one-pass kernels for x's rows, dy's rows and cols (one pass) and x's cols; SwiGLU's
  # kernels write the rest, where the unfused path runs none here
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
  cpu = current_device()
  assert not mlp.applies(M, wg, wu, wd, JET, cpu)  # a CPU program: the XLA path
  assert not mlp.norm_applies(M, jnp.ones((D,)), wg, JET, cpu)
  gpu = GPU
  assert mlp.applies(M, wg, wu, wd, JET, gpu)
  assert not mlp.applies(256, wg, wu, wd, JET, gpu)  # a decode step's rows
  assert not mlp.applies(M + 64, wg, wu, wd, JET, gpu)  # rows off the 128-tile
  assert not mlp.applies(M, wg[:, :320], wu[:, :320], wd[:320], JET, gpu)  # F off the tile
  assert not mlp.applies(M, wg, wu, wd, get_recipe("bf16").train, gpu)
  assert not mlp.applies(M, wg, wu, wd, get_recipe("jet").rollout, gpu)  # no backward
  assert not mlp.applies(M, wg, wu, wd, get_recipe("jet_exact").train, gpu)  # exact sums
  frozen = prequantize_weight(wg, JET.fprop)
  assert not mlp.applies(M, frozen, wu, wd, JET, gpu)
  norm = jnp.ones((D,), jnp.float32)
  assert mlp.norm_applies(M, norm, wg, JET, gpu)
  assert not mlp.norm_applies(M, norm[:128], wg, JET, gpu)  # a norm of another width
  assert not mlp.norm_applies(M, norm, frozen, JET, gpu)
  assert not mlp.norm_applies(M, norm, wg, get_recipe("bf16").train, gpu)
  off = dataclasses.replace(GPU, kernels=KernelConfig(fused_mlp=False))
  assert not mlp.applies(M, wg, wu, wd, JET, off)
  assert not _plan(JET, False).fused_mlp(M, wg, wu, wd) and _plan(JET).fused_mlp(M, wg, wu, wd)


def test_a_bad_setting_is_refused():
  with pytest.raises(ValueError, match="JETRL_FUSED_MLP must be 0, 1 or unset"):
    KernelConfig.from_env({"JETRL_FUSED_MLP": "yes"})
  assert KernelConfig.from_env({"JETRL_FUSED_MLP": "0"}).fused_mlp is False


@pytest.fixture(scope="module")
def norm_runs():
  """The MLP and one projection behind their RMSNorm (mlp.swiglu_mlp(norm=...), mlp.norm_linear),
  against the unfused path: layers.rms_norm, then layers.swiglu and layers.project."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(M, D)) * 2, jnp.bfloat16)
  layer = dict(_layer(rng), mlp_norm=jnp.asarray(1 + 0.1 * rng.normal(size=(D,)), jnp.float32))
  layer["w"] = jnp.asarray(rng.normal(size=(D, 512)) / 16, jnp.float32)
  r1 = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  r2 = jnp.asarray(rng.normal(size=(M, 512)), jnp.float32)
  mlp_w = ("w_gate", "w_up", "w_down")

  def loss(x, layer, fused):
    if fused:
      norm = (layer["mlp_norm"], 1e-6)
      plan = _plan(JET)
      y = plan.mlp(x, *(layer[k] for k in mlp_w), norm=norm)
      z = plan.norm_linear(x, layer["mlp_norm"], 1e-6, layer["w"])
    else:  # the norm's own pass, as the layers run it
      plan = _plan(JET)
      h = layers.rms_norm(x, layer["mlp_norm"], 1e-6, jnp.bfloat16)
      y = layers.swiglu(h, {k: layer[k] for k in mlp_w}, plan, jnp.bfloat16)
      z = layers.project(h, layer["w"], plan, jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) * r1) + jnp.sum(z.astype(jnp.float32) * r2)

  out = {}
  for fused in (True, False):
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda a, b: loss(a, b, fused), argnums=(0, 1)))(x, layer))
    out[fused] = (
      jaxpr,
      jax.jit(jax.grad(lambda a, b: loss(a, b, fused), argnums=(0, 1)))(x, layer),
    )
  return (x, layer, r1, r2), out


def _norm_reference(x, layer, r1, r2):
  """float64 gradients of sum(mlp(h) r1) + sum((h @ w) r2), h = x / rms(x) * bf16(norm weight):
  dh by hand, then the norm's backward, dx = s (g - x s^2 mean(g x)), g = dh * weight."""
  X, R1, R2 = (np.asarray(a, np.float64) for a in (x, r1, r2))
  Wn = np.asarray(jnp.asarray(layer["mlp_norm"], jnp.bfloat16), np.float64)
  Wg, Wu, Wd, W = (np.asarray(layer[k], np.float64) for k in ("w_gate", "w_up", "w_down", "w"))
  s = 1 / np.sqrt(np.mean(X * X, axis=1, keepdims=True) + 1e-6)
  H = X * s * Wn
  G, U = H @ Wg, H @ Wu
  sig = 1 / (1 + np.exp(-G))
  dHid = R1 @ Wd.T
  dG, dU = dHid * U * sig * (1 + G * (1 - sig)), dHid * G * sig
  dH = dG @ Wg.T + dU @ Wu.T + R2 @ W.T
  g = dH * Wn
  dX = s * (g - X * s * s * np.mean(g * X, axis=1, keepdims=True))
  return {
    "x": dX,
    "mlp_norm": np.sum(dH * X * s, axis=0),
    "w_gate": H.T @ dG,
    "w_up": H.T @ dU,
    "w_down": (G * sig * U).T @ R1,
    "w": H.T @ R2,
  }


def test_the_norms_kernel_feeds_the_gemms_and_the_gradients_hold(norm_runs):
  (x, layer, r1, r2), out = norm_runs
  fused_jaxpr, (dx1, dw1) = out[True]
  _, (dx2, dw2) = out[False]
  assert fused_jaxpr.count("name=fp8_norm_rows_cols") == 2  # the MLP's and the projection's
  ref = _norm_reference(x, layer, r1, r2)
  got = {"x": dx1, **dw1}
  plain = {"x": dx2, **dw2}
  err = lambda a, want: np.linalg.norm(np.asarray(a, np.float64) - want) / np.linalg.norm(want)
  for name, want in ref.items():
    e1, e2 = err(got[name], want), err(plain[name], want)
    assert e1 < 0.1 and e1 <= 1.02 * e2, (name, e1, e2)
  # the projection's and up's / down's weight gradients read the same FP8 groups as the
  # unfused path's (the norm's value bit for bit here): equal to float32 sums
  for name in ("w", "w_up", "w_down"):
    assert err(got[name], np.asarray(plain[name], np.float64)) < 1e-5, name
