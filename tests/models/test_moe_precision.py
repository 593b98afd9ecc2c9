"""A mixture of experts under the precision recipes: every expert projection is an FP8
`linear` of its own (128x128 weight blocks per expert, 1x128 groups per token), the router is
not; a token's output does not depend on the other tokens; the rollout is the training
forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.kernels import Plan
from jetrl.models.rollout_weights import prequantize_linear_weights, rollout_weights
from jetrl.precision import QuantizedWeight, dequantize, get_recipe, quantize
from model_helpers import tiny_config

# Every expert matrix holds whole 128x128 blocks (2 x 1 or 1 x 2), d_model 256 = 2 groups.
CONFIG = tiny_config("qwen3_moe", vocab=128, d_model=256, heads=(4, 2, 64), d_ff=128)
B, T = 2, 12


@pytest.fixture(scope="module")
def params():
  p = M.init_params(CONFIG, jax.random.PRNGKey(0))
  return jax.tree_util.tree_map(lambda a: a * 3.0 if a.ndim >= 2 else a, p)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, CONFIG.vocab_size)


@pytest.fixture(scope="module")
def fwd():
  """(logits, chosen experts [B, T, L, k]) of one compiled forward per precision."""

  def run(p, t, precision):
    logits = M.forward(p, CONFIG, t, precision=precision)
    _, routes = M.hidden_states(p, CONFIG, t, precision=precision, routing=True)
    return logits, routes.experts

  return jax.jit(run, static_argnames=("precision",))


def test_expert_projections_are_linears_and_the_router_is_not(params, tokens, monkeypatch):
  calls, routers = [], []
  real_linear, real_router = Plan.linear, Plan.router

  def spy(plan, x, w):
    calls.append((tuple(w.shape), w.dtype, plan.precision))
    return real_linear(plan, x, w)

  def spy_router(plan, x, w, cd):
    routers.append((tuple(w.shape), plan.precision))
    return real_router(plan, x, w, cd)

  monkeypatch.setattr(Plan, "linear", spy)
  monkeypatch.setattr(Plan, "router", spy_router)
  precision = get_recipe("jet").train
  jax.make_jaxpr(lambda p: M.forward(p, CONFIG, tokens, precision=precision))(params)
  # Attention's q / k / v (fused) and o, then one expert's gate, up and down (the scan over
  # the experts traces its body once), for the scanned layer: each slice [in, out] of one
  # expert, float32 as stored.
  shapes = sorted(c[0] for c in calls)
  assert shapes == sorted([(256, 512), (256, 256), (256, 128), (256, 128), (128, 256)])
  assert all(c[2] is precision and c[1] == jnp.float32 for c in calls)
  assert routers == [((256, 4), precision)]


def _np_fp8(a, block):
  """a dequantized from its E4M3 values in `block` groups, as float64."""
  a = jnp.asarray(a, jnp.float32)
  return np.asarray(dequantize(*quantize(a, block), block), np.float64)


def _np_fp8_linear(x, w_fp8):
  """float64 reference of the FP8 fprop: x [N, K] in 1x128 groups (each row its own), w
  already in 128x128 blocks (`_np_fp8(w, (128, 128))`)."""
  return _np_fp8(x, (1, 128)) @ w_fp8


def test_fp8_experts_match_a_numpy_reference(params):
  """The MoE block under jet's training precision against float64 numpy: routing from the
  router's softmax of its bf16 logits (ties: lower index first), each chosen expert's three
  projections FP8 (tolerance: the bf16 values between operators), the unquantized float64
  experts further away."""
  layer = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
  h = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (16, 256)), np.float32)
  precision = get_recipe("jet").train
  y, routing = jax.jit(lambda hh: M.moe_mlp(hh, layer, CONFIG, precision, jnp.bfloat16))(
    jnp.asarray(h, jnp.bfloat16)
  )
  hb = np.asarray(jnp.asarray(h, jnp.bfloat16), np.float64)
  logits = hb @ np.asarray(jnp.asarray(layer["router"], jnp.bfloat16), np.float64)
  logits = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64)  # the router's output
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, axis=-1, kind="stable")[:, :2]
  np.testing.assert_array_equal(np.asarray(routing.experts), top)
  want_fp8, want_exact = np.zeros_like(hb), np.zeros_like(hb)
  for e in range(CONFIG.n_experts):
    # Every token through expert e (rows are independent: 1x128 groups per row), then each
    # token's share of it where e is among its top 2.
    ws = [np.asarray(layer[k][e], np.float64) for k in M.EXPERT_WEIGHTS]
    for lin, out, w in (
      (_np_fp8_linear, want_fp8, [_np_fp8(w, (128, 128)) for w in ws]),
      (np.matmul, want_exact, ws),
    ):
      a, b = lin(hb, w[0]), lin(hb, w[1])
      y_e = lin(a / (1 + np.exp(-a)) * b, w[2])
      chosen = top == e  # [16, 2]
      we = np.sum(np.where(chosen, p[np.arange(16)[:, None], top], 0.0), -1)
      we /= p[np.arange(16)[:, None], top].sum(-1)
      out += we[:, None] * y_e
  got = np.asarray(y, np.float64)
  err = lambda want: np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err(want_fp8) < 2e-2, err(want_fp8)
  assert err(want_fp8) < 0.5 * err(want_exact), (err(want_fp8), err(want_exact))


@pytest.mark.parametrize("recipe", ["jet", "jet_exact"])
def test_a_tokens_output_does_not_depend_on_the_other_tokens(params, recipe):
  """Token 0's MoE output alone, and among 15 others routed to its experts and others: the
  same FP8 groups (per token); bit for bit under jet_exact, whose sums are exact."""
  layer = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
  h = jax.random.normal(jax.random.PRNGKey(6), (16, 256)).astype(jnp.bfloat16) * 4.0
  precision = get_recipe(recipe).train
  f = jax.jit(lambda hh: M.moe_mlp(hh, layer, CONFIG, precision, jnp.bfloat16))
  alone, r1 = f(h[:1])
  among, r16 = f(h)
  np.testing.assert_array_equal(np.asarray(r1.experts[0]), np.asarray(r16.experts[0]))
  a, b = np.asarray(alone[0], np.float32), np.asarray(among[0], np.float32)
  if recipe == "jet_exact":
    np.testing.assert_array_equal(a, b)
  else:  # float32 sums of another GEMM shape; bf16 outputs
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


def test_jet_rollout_is_the_training_forward_and_close_to_bf16(params, tokens, fwd):
  jet = get_recipe("jet")
  train, r_jet = fwd(params, tokens, precision=jet.train)
  rollout, r_rollout = fwd(params, tokens, precision=jet.rollout)
  np.testing.assert_array_equal(np.asarray(rollout), np.asarray(train))
  np.testing.assert_array_equal(np.asarray(r_rollout), np.asarray(r_jet))
  bf16, r_bf16 = fwd(params, tokens, precision=get_recipe("bf16").train)
  gap = float(jnp.linalg.norm(train - bf16) / jnp.linalg.norm(bf16))
  # FP8 moves the router's inputs: some tokens choose other experts than under bf16, which
  # moves their logits further than a dense model's FP8 rounding does.
  same = np.all(np.sort(np.asarray(r_jet), -1) == np.sort(np.asarray(r_bf16), -1), -1)
  print(
    f"jet vs bf16: relative logit gap {gap:.3f}, (token, layer) routing equal {same.mean():.3f}"
  )
  assert 0 < gap < 0.5 and same.mean() > 0.75, (gap, same.mean())


def test_jet_gradient_reaches_router_and_only_routed_experts(params):
  """Under jet (FP8 dgrad and wgrad) the MoE block's router and experts get gradients; an
  expert the token did not choose (2 of the 4) gets exactly zero."""
  jet = get_recipe("jet").train
  layer = {k: params["layers"][k][0] for k in ("router",) + M.EXPERT_WEIGHTS}
  h = jax.random.normal(jax.random.PRNGKey(7), (1, 256)).astype(jnp.bfloat16)

  def loss(lay):
    y, routing = M.moe_mlp(h, lay, CONFIG, jet, jnp.bfloat16)
    return y.astype(jnp.float32).sum(), routing.experts

  g, chosen = jax.jit(jax.grad(loss, has_aux=True))(layer)
  used = set(np.asarray(chosen).ravel().tolist())
  assert len(used) == 2 and float(jnp.abs(g["router"]).max()) > 0
  for e in range(CONFIG.n_experts):
    for k in M.EXPERT_WEIGHTS:
      gmax = float(jnp.abs(g[k][e]).max())
      assert (gmax > 0) == (e in used), (k, e, used, gmax)


def test_rollout_quantizes_each_expert_once(params):
  """A rollout's weights hold every expert's projections as FP8 values quantized once, each
  expert's blocks exactly those of quantizing its [K, N] alone; the MoE block reads them to
  the same bits as it does quantizing the stored weights itself."""
  jet = get_recipe("jet").rollout
  rw = rollout_weights(params, jet)
  layer, stored = rw["layers"][1], jax.tree_util.tree_map(lambda a: a[1], params["layers"])
  for k in M.EXPERT_WEIGHTS:
    w = layer[k]
    assert isinstance(w, QuantizedWeight) and w.q.dtype == jnp.float8_e4m3fn, (k, w)
    assert w.shape == stored[k].shape
    for e in range(CONFIG.n_experts):
      alone = prequantize_linear_weights({"layers": {"wq": stored[k][e]}}, jet)["layers"]["wq"]
      got = jax.tree_util.tree_map(lambda a: a[e], w)
      assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(alone)
      jax.tree_util.tree_map(np.testing.assert_array_equal, got, alone)
  assert not isinstance(layer["router"], QuantizedWeight)
  h = jax.random.normal(jax.random.PRNGKey(8), (6, 256)).astype(jnp.bfloat16)
  f = jax.jit(lambda lay: M.moe_mlp(h, lay, CONFIG, jet, jnp.bfloat16))
  (y_q, r_q), (y, r) = f(layer), f(stored)
  np.testing.assert_array_equal(np.asarray(r_q.experts), np.asarray(r.experts))
  np.testing.assert_array_equal(np.asarray(y_q, np.float32), np.asarray(y, np.float32))
