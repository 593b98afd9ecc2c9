"""A mixture of experts in the unified flow: under `jet_exact` the rollout's log-probs and its
expert choices are the training forward's bit for bit (routing agreement exactly 1 in the
update's metrics); under `jet` the log-probs are close; the load-balancing loss in the update."""

import jax
import numpy as np
import pytest

from jetrl import models as M
from jetrl.precision import get_recipe
from jetrl.rl import UpdateConfig, init_train_state, make_train_batch, policy_logprobs, update_step
from jetrl.rl.routing import completion_routing, load_balancing_loss
from jetrl.sampling import SamplingConfig, sample

CONFIG = M.ModelConfig(
  family="qwen3_moe", vocab_size=64, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1,
  head_dim=64, d_ff=128, qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=128,
)  # fmt: skip
EXACT, JET = get_recipe("jet_exact"), get_recipe("jet")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11]]
SC = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, pad_id=0, prompt_len=8)
_lp = jax.jit(
  policy_logprobs, static_argnames=("model_config", "precision", "chunk_size", "routing")
)


@pytest.fixture(scope="module")
def params():
  p = M.init_params(CONFIG, jax.random.PRNGKey(0))
  return jax.tree_util.tree_map(lambda a: a * 3.0 if a.ndim >= 2 else a, p)


@pytest.fixture(scope="module", params=["jet_exact", "jet"])
def rollout(request, params):
  """(recipe name, the rollout, its TrainBatch, the training forward's log-probs and routing
  of that batch)."""
  recipe = get_recipe(request.param)
  out = jax.tree_util.tree_map(
    np.asarray, sample(params, CONFIG, PROMPTS, jax.random.PRNGKey(1), SC, recipe.rollout)
  )
  batch = make_train_batch(
    out.prompt_tokens,
    out.prompt_mask,
    out.tokens,
    out.mask,
    out.logprobs,
    np.linspace(-1, 1, len(out.tokens)),
    out.routes,
  )
  lp, _, routing = _lp(
    params, model_config=CONFIG, batch=batch, precision=recipe.train, chunk_size=16, routing=True
  )
  return request.param, out, batch, np.asarray(lp), routing


def test_rollout_logprobs_and_routes_against_the_training_forward(rollout):
  name, out, batch, lp, routing = rollout
  t = out.tokens.shape[1]
  assert out.routes.shape == (8, t, CONFIG.n_layers, CONFIG.experts_per_token)
  assert out.mask.sum() >= 40
  d = np.abs(lp - out.logprobs)[out.mask]
  fed = out.mask[:, : t - 1]  # every generated token but the last went back through the model
  got = np.asarray(completion_routing(routing, t).experts)[fed]
  want = out.routes[:, : t - 1][fed]
  same = np.all(np.sort(got, -1) == np.sort(want, -1), -1)
  print(f"{name}: max |dlogp| {d.max():.3g}, (token, layer) routing equal {same.mean():.3f}")
  if name == "jet_exact":
    assert d.max() == 0.0
    np.testing.assert_array_equal(got, want)  # the same experts, in the same order
  else:
    assert d.max() < 1.0 and d.mean() < 0.05


@pytest.mark.parametrize("old_logp", ["same_forward", "recompute"])
def test_update_logs_routing_agreement(params, rollout, old_logp):
  """From the differentiated forward itself (same_forward) or the pre-update forward in
  micro-batches (recompute; jet_exact only, to keep the compiles few). jet_exact's
  same_forward update also carries the load-balancing loss (router_aux_coef > 0, one
  micro-batch: the whole batch): the loss gains coef x the load-balancing loss of the
  training forward's routing over the real positions."""
  name, _, batch, _, routing = rollout
  if old_logp == "recompute" and name != "jet_exact":
    pytest.skip("one recipe is enough")
  aux = 0.5 if (name, old_logp) == ("jet_exact", "same_forward") else 0.0
  recipe = get_recipe(name)
  micro = 1 if aux else 2
  ucfg = UpdateConfig(chunk_size=16, old_logp=old_logp, micro_batches=micro, router_aux_coef=aux)
  _, m = update_step(
    init_train_state(params, ucfg),
    batch,
    jax.random.PRNGKey(0),
    model_config=CONFIG,
    cfg=ucfg,
    precision=recipe.train,
    temperature=SC.temperature,
  )
  route = {k: float(m["agree/" + k]) for k in ("route_agree", "route_agree_layer")}
  shift = float(m["agree/route_rank_shift"])
  if name == "jet_exact":
    assert route == {"route_agree": 1.0, "route_agree_layer": 1.0} and shift == 0.0
    assert float(m["agree/abs_diff_max"]) == 0.0
  else:
    assert 0.5 <= route["route_agree"] <= route["route_agree_layer"] <= 1.0 and shift >= 0.0
  if not aux:
    assert "router_aux_loss" not in m
    return
  want = float(load_balancing_loss(routing, batch.attention_mask))
  assert want >= 1.0  # E * sum f P >= 1 (equality: perfectly balanced)
  np.testing.assert_allclose(float(m["router_aux_loss"]), want, rtol=1e-5)
  # loss = pg - 0 * entropy + 0.5 * router_aux
  np.testing.assert_allclose(float(m["loss"]) - float(m["pg_loss"]), aux * want, rtol=1e-5)


def test_load_balancing_loss_is_refused_for_a_dense_model(rollout):
  _, _, batch, _, _ = rollout
  dense = M.ModelConfig(family="qwen3", qk_norm=True)
  with pytest.raises(ValueError, match="router_aux_coef=0.5 is a mixture of experts'"):
    update_step(
      init_train_state(M.init_params(dense, jax.random.PRNGKey(0)), UpdateConfig()),
      batch,
      jax.random.PRNGKey(0),
      model_config=dense,
      cfg=UpdateConfig(router_aux_coef=0.5),
      precision=get_recipe("fp32").train,
    )
