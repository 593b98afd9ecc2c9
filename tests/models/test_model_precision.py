"""The model under the precision recipes: every projection through `linear`, dtypes, jet vs bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.kernels import Plan
from jetrl.models import layers
from jetrl.precision import get_recipe
from model_helpers import tiny_config

# d_model, q/kv dims and d_ff are multiples of 128 with >= 2 blocks: real FP8 block tiling.
CONFIG = tiny_config("qwen3", vocab=256, d_model=256, heads=(4, 2, 64), d_ff=512, rope_theta=1e6)
B, T = 2, 16


@pytest.fixture(scope="module")
def params():
  return M.init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, CONFIG.vocab_size)


@pytest.fixture(scope="module")
def fwd():
  return jax.jit(M.forward, static_argnames=("config", "precision"))


@pytest.mark.parametrize("recipe", ["jet", "fp8_tensor"])
def test_every_projection_calls_linear_with_the_precision(params, tokens, monkeypatch, recipe):
  """Under jet's 128-blocks q / k / v (256, 128, 128 wide) run as one GEMM on their weights
  concatenated (gate and up stay apart in training); one scale per tensor (fp8_tensor) keeps
  all seven apart (a shared scale would change each part's values)."""
  calls = []
  real = Plan.linear  # every projection of the layers goes through its plan's `linear`

  def spy(plan, x, w):
    calls.append((tuple(w.shape), w.dtype, plan.precision))
    return real(plan, x, w)

  monkeypatch.setattr(Plan, "linear", spy)
  precision = get_recipe(recipe).train
  jax.make_jaxpr(lambda p: M.forward(p, CONFIG, tokens, precision=precision))(params)
  per_layer = {
    name: shape[1:]
    for name, shape in M.param_shapes(CONFIG)["layers"].items()
    if name.startswith("w")
  }
  assert per_layer["wq"] == (256, 256) and per_layer["wk"] == per_layer["wv"] == (256, 128)
  if recipe == "jet":
    want = [(256, 512), (256, 256), (256, 512), (256, 512), (512, 256)]  # qkv, o, gate, up, down
  else:
    want = list(per_layer.values())
  assert sorted(c[0] for c in calls) == sorted(want)
  assert all(c[2] is precision for c in calls)
  # The stored weights themselves (float32 here), never a bf16 copy, reach the quantizer.
  assert all(c[1] == jnp.float32 for c in calls)


@pytest.mark.parametrize(
  "recipe,dtype",
  [
    ("fp32", jnp.float32),
    ("bf16", jnp.bfloat16),
    ("fp8_rollout", jnp.bfloat16),
    ("jet", jnp.bfloat16),
    ("fp8_tensor", jnp.bfloat16),
  ],
)
def test_activation_dtypes(params, tokens, recipe, dtype):
  prec = get_recipe(recipe).train
  h = jax.eval_shape(lambda p: M.hidden_states(p, CONFIG, tokens, precision=prec), params)
  assert h.dtype == dtype and h.shape == (B, T, CONFIG.d_model)
  out = jax.eval_shape(lambda p: M.forward(p, CONFIG, tokens, precision=prec), params)
  assert out.dtype == jnp.float32 and out.shape == (B, T, CONFIG.vocab_size)
  cache = M.init_cache(CONFIG, B, T, dtype)
  logits, new = jax.eval_shape(
    lambda p, c: M.forward_cached(
      p, CONFIG, tokens, c, positions=tokens, token_mask=tokens > 0, precision=prec, last_only=True
    ),
    params,
    cache,
  )
  assert logits.shape == (B, 1, CONFIG.vocab_size) and logits.dtype == jnp.float32
  assert all(a.dtype == dtype for a in new.k + new.v)


def test_precision_none_runs_in_params_dtype(tokens):
  bf = M.init_params(CONFIG, jax.random.PRNGKey(2), dtype=jnp.bfloat16)
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: x.dtype == jnp.bfloat16, bf))
  h = jax.eval_shape(lambda p: M.hidden_states(p, CONFIG, tokens), bf)
  assert h.dtype == jnp.bfloat16
  assert jax.eval_shape(lambda p: M.forward(p, CONFIG, tokens), bf).dtype == jnp.float32


def _gap(a, b):
  """Relative RMS gap ||a - b|| / ||b||."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_jet_logits_close_to_bf16(params, tokens, fwd):
  f32 = fwd(params, config=CONFIG, tokens=tokens, precision=get_recipe("fp32").train)
  bf16 = fwd(params, config=CONFIG, tokens=tokens, precision=get_recipe("bf16").train)
  jet = get_recipe("jet")
  jet_train = fwd(params, config=CONFIG, tokens=tokens, precision=jet.train)
  jet_rollout = fwd(params, config=CONFIG, tokens=tokens, precision=jet.rollout)
  # Unified flow: the rollout is the training forward, bit for bit.
  np.testing.assert_array_equal(np.asarray(jet_rollout), np.asarray(jet_train))
  bf16_gap, jet_gap = _gap(bf16, f32), _gap(jet_train, bf16)
  max_gap = float(jnp.max(jnp.abs(jet_train - bf16)) / jnp.max(jnp.abs(bf16)))
  p_jet, p_bf16 = jax.nn.log_softmax(jet_train), jax.nn.log_softmax(bf16)
  kl = float(jnp.mean(jnp.sum(jnp.exp(p_bf16) * (p_bf16 - p_jet), axis=-1)))
  msg = (
    f"||jet - bf16|| / ||bf16|| = {jet_gap:.3e} (max-abs / max-abs {max_gap:.3e}); "
    f"||bf16 - fp32|| / ||fp32|| = {bf16_gap:.3e}; mean KL(bf16 || jet) = {kl:.3e} nats"
  )
  print(msg)
  assert jet_gap < 0.15, msg
  assert jet_gap > 2 * bf16_gap, "FP8 should add error over bf16: " + msg
  assert kl < 5e-3, msg


def test_fp8_rollout_differs_from_its_training_forward(params, tokens, fwd):
  r = get_recipe("fp8_rollout")
  train = fwd(params, config=CONFIG, tokens=tokens, precision=r.train)
  rollout = fwd(params, config=CONFIG, tokens=tokens, precision=r.rollout)
  assert _gap(rollout, train) > 0


def test_jet_gradient_close_to_bf16(params, tokens):
  targets = jnp.roll(tokens, -1, axis=1)

  def grads(recipe):
    prec = get_recipe(recipe).train

    def loss(p):
      logp, _ = M.token_logprobs(p, CONFIG, tokens, targets, precision=prec, chunk_size=T)
      return -jnp.mean(logp)

    g = jax.jit(jax.grad(loss))(params)
    return np.concatenate(
      [np.ravel(np.asarray(x, np.float64)) for x in jax.tree_util.tree_leaves(g)]
    )

  g_bf16, g_jet = grads("bf16"), grads("jet")
  assert np.all(np.isfinite(g_jet))
  cos = float(g_jet @ g_bf16 / (np.linalg.norm(g_jet) * np.linalg.norm(g_bf16)))
  assert cos > 0.95, f"cosine(jet grad, bf16 grad) = {cos:.4f}"


def test_fused_gemm_is_each_parts_own_under_jet(params):
  """Why q / k / v may run as one GEMM under jet: with every part's width a multiple of the
  128-block, the concatenated weight's tiles and the output gradient's 1 x 128 groups never
  straddle two parts, so the fused fprop, dgrad and wgrad equal the separate ones to float32
  accumulation order (a shared tile would rescale a part: errors of FP8's size, ~1e-2)."""
  from jetrl.kernels import linear

  prec = get_recipe("jet").train
  layer = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
  parts = ("wq", "wk", "wv")
  assert layers.fusable(layer, parts, prec)
  assert not layers.fusable(layer, parts, get_recipe("fp8_tensor").train)
  assert not layers.fusable(dict(layer, wk=layer["wk"][:, :64]), parts, prec)  # 64 < a block
  ws = [layer[p] for p in parts]
  kx, kg = jax.random.split(jax.random.PRNGKey(7))
  x = jax.random.normal(kx, (2, 32, CONFIG.d_model), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (2, 32, sum(w.shape[1] for w in ws)), jnp.float32)

  def fused(x, *ws):
    return linear(x, jnp.concatenate(ws, axis=-1), prec).astype(jnp.float32)

  def separate(x, *ws):
    return jnp.concatenate([linear(x, w, prec).astype(jnp.float32) for w in ws], axis=-1)

  outs = {}
  for name, fn in (("fused", fused), ("separate", separate)):
    y, vjp = jax.vjp(fn, x, *ws)
    outs[name] = [np.asarray(a, np.float64) for a in (y, *vjp(dy))]
  for i, (a, b) in enumerate(zip(outs["fused"], outs["separate"])):
    rel = np.abs(a - b).max() / np.abs(b).max()
    # dx (i = 1) leaves the dgrad GEMM in bf16, as x is: one bf16 rounding apart at most.
    assert rel < (8e-3 if i == 1 else 1e-5), (i, rel)
  # FP8's own error, for scale: the fused forward against float32's x @ w.
  ref = np.asarray(x, np.float64) @ np.concatenate([np.asarray(w, np.float64) for w in ws], -1)
  assert np.abs(outs["fused"][0] - ref).max() / np.abs(ref).max() > 1e-3
