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
from jetrl.precision import dequantize, get_recipe, quantize
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
  return jax.jit(M.forward, static_argnames=("config", "precision"))


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


def _np_fp8_linear(x, w):
  """float64 reference of the FP8 fprop: x in 1x128 groups, w in 128x128 blocks (E4M3)."""
  xq = np.asarray(dequantize(*quantize(jnp.asarray(x, jnp.float32), (1, 128)), (1, 128)))
  wq = np.asarray(dequantize(*quantize(jnp.asarray(w, jnp.float32), (128, 128)), (128, 128)))
  return xq.astype(np.float64) @ wq.astype(np.float64)


def test_fp8_experts_match_a_numpy_reference(params):
  """The MoE block under jet's training precision against float64 numpy: routing from the
  router's softmax of its bf16 logits (ties: lower index first), each chosen expert's three projections FP8 (tolerance: the bf16 values
  between operators), the unquantized float64 experts further away."""
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
  for n in range(16):
    w = p[n, top[n]] / p[n, top[n]].sum()
    for e, we in zip(top[n], w):
      g, u, d = (np.asarray(layer[k][e], np.float64) for k in M.EXPERT_WEIGHTS)
      for lin, out in ((_np_fp8_linear, want_fp8), (np.matmul, want_exact)):
        a = lin(hb[n : n + 1], g)
        b = lin(hb[n : n + 1], u)
        out[n] += we * lin(a / (1 + np.exp(-a)) * b, d)[0]
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
  train = fwd(params, config=CONFIG, tokens=tokens, precision=jet.train)
  rollout = fwd(params, config=CONFIG, tokens=tokens, precision=jet.rollout)
  np.testing.assert_array_equal(np.asarray(rollout), np.asarray(train))
  bf16_p = get_recipe("bf16").train
  bf16 = fwd(params, config=CONFIG, tokens=tokens, precision=bf16_p)
  gap = float(jnp.linalg.norm(train - bf16) / jnp.linalg.norm(bf16))
  # FP8 moves the router's inputs: some tokens choose other experts than under bf16, which
  # moves their logits further than a dense model's FP8 rounding does.
  _, r_jet = M.hidden_states(params, CONFIG, tokens, precision=jet.train, routing=True)
  _, r_bf16 = M.hidden_states(params, CONFIG, tokens, precision=bf16_p, routing=True)
  same = np.all(
    np.sort(np.asarray(r_jet.experts), -1) == np.sort(np.asarray(r_bf16.experts), -1), -1
  )
  print(
    f"jet vs bf16: relative logit gap {gap:.3f}, (token, layer) routing equal {same.mean():.3f}"
  )
  assert 0 < gap < 0.5 and same.mean() > 0.75, (gap, same.mean())


def test_jet_gradient_reaches_router_and_only_routed_experts(params, tokens):
  """Under jet (FP8 dgrad and wgrad) the router and the experts get gradients; an expert no
  token chose gets exactly zero."""
  jet = get_recipe("jet").train
  toks = tokens[:1, :2]  # 2 tokens x 2 experts each: at most 4 of 4 experts per layer

  def loss(p):
    return M.forward(p, CONFIG, toks, precision=jet).astype(jnp.float32).sum()

  g = jax.jit(jax.grad(loss))(params)["layers"]
  _, routes = M.hidden_states(params, CONFIG, toks, precision=jet, routing=True)
  chosen = np.asarray(routes.experts)  # [1, 2, L, k]
  assert float(jnp.abs(g["router"]).max()) > 0
  for layer in range(CONFIG.n_layers):
    used = set(chosen[0, :, layer].ravel().tolist())
    for e in range(CONFIG.n_experts):
      gmax = float(jnp.abs(g["experts_gate"][layer, e]).max())
      assert (gmax > 0) == (e in used), (layer, e, used, gmax)
