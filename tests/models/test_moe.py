"""Qwen3-MoE against `transformers` (CPU torch, float32): load, forward, greedy decoding,
export, the load-balancing loss; dense layers among the experts refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.models.io.hf_config import config_from_hf
from jetrl.precision import get_recipe
from jetrl.rl.routing import load_balancing_loss
from jetrl.sampling import SamplingConfig, sample
from model_helpers import HF_SHAPE, hf_logits, hf_model, perturbed, rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
MOE = dict(num_experts=4, moe_intermediate_size=32)
CASES = {
  "top2_normed": dict(MOE, num_experts_per_tok=2, norm_topk_prob=True),
  "top3_raw_tied": dict(
    MOE, num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True, rope_theta=1e6
  ),
}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
  model = hf_model("qwen3_moe", seed=3 + len(request.param), **CASES[request.param])
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(str(path))
  config, params = M.load_pretrained(str(path))
  return request.param, model, config, params


def test_config_read_from_checkpoint(loaded):
  name, model, config, params = loaded
  hf = model.config
  assert config.family == "qwen3_moe" and config.moe
  assert (config.n_experts, config.experts_per_token, config.moe_d_ff) == (
    hf.num_experts,
    hf.num_experts_per_tok,
    hf.moe_intermediate_size,
  )
  assert config.norm_topk_prob == hf.norm_topk_prob
  assert params["layers"]["experts_gate"].shape == (2, 4, 64, 32)
  assert params["layers"]["experts_down"].shape == (2, 4, 32, 64)
  assert params["layers"]["router"].shape == (2, 64, 4)
  assert "w_gate" not in params["layers"]
  # Expert 2 of layer 1 is that expert's torch weight, transposed.
  want = model.model.layers[1].mlp.experts.gate_up_proj[2, :32].detach().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["experts_gate"][1, 2]), want)
  assert sum(p.numel() for p in model.parameters()) == config.n_params


@pytest.mark.parametrize("precision", ["none", "fp32"])
def test_logits_match_transformers(loaded, precision):
  _, model, config, params = loaded
  tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 24))
  want = hf_logits(model, tokens)
  prec = None if precision == "none" else get_recipe("fp32").train
  got = M.forward(params, config, jnp.asarray(tokens, jnp.int32), precision=prec)
  err = rel_err(got, want)
  assert err < TOL, f"relative logit error {err:.2e} vs transformers"


def test_routing_matches_transformers(loaded):
  """Each layer's router probabilities and chosen experts are transformers' own."""
  _, model, config, params = loaded
  tokens = np.random.RandomState(2).randint(0, config.vocab_size, (2, 12))
  with torch.no_grad():
    out = model(torch.tensor(tokens), output_router_logits=True)
  _, routes = M.hidden_states(params, config, jnp.asarray(tokens), routing=True)
  for layer, logits in enumerate(out.router_logits):
    probs = torch.softmax(logits.float(), -1)
    want = torch.topk(probs, config.experts_per_token, -1).indices.numpy().reshape(2, 12, -1)
    np.testing.assert_array_equal(np.asarray(routes.experts[:, :, layer]), want)
    got = np.asarray(routes.probs[:, :, layer]).reshape(-1, config.n_experts)
    np.testing.assert_allclose(got, probs.numpy(), atol=1e-6)


def test_greedy_tokens_match_transformers(loaded):
  _, model, config, params = loaded
  prompts = [[1, 2, 3, 1], [7, 30, 2]]
  sc = SamplingConfig(max_new_tokens=8, temperature=0.0, pad_id=0)
  ours = sample(params, config, prompts, jax.random.PRNGKey(0), sc)
  for i, p in enumerate(prompts):
    with torch.no_grad():
      want = model.generate(
        torch.tensor([p]),
        max_new_tokens=8,
        do_sample=False,
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
        eos_token_id=None,
        pad_token_id=0,
      )[0, len(p) :].tolist()
    assert np.asarray(ours.tokens[i]).tolist() == want, f"prompt {p}"


def test_load_balancing_loss_matches_transformers(loaded):
  """transformers' aux_loss (load_balancing_loss_func over every layer, padding masked)."""
  _, model, config, params = loaded
  rng = np.random.RandomState(3)
  tokens = rng.randint(0, config.vocab_size, (3, 10))
  mask = (np.arange(10)[None] < np.array([[10], [6], [3]])).astype(np.int64)
  with torch.no_grad():
    want = model(
      torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True
    ).aux_loss
  _, routes = M.hidden_states(
    params, config, jnp.asarray(tokens), attention_mask=jnp.asarray(mask), routing=True
  )
  got = load_balancing_loss(routes, jnp.asarray(mask))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_load_balancing_loss_by_hand():
  """Two positions, one layer, 3 experts, top 1: f = (1/2, 1/2, 0), P = mean of the probs."""
  probs = np.array([[0.7, 0.2, 0.1], [0.3, 0.6, 0.1], [0.1, 0.1, 0.8]], np.float32)
  experts = np.array([[0], [1], [2]], np.int32)
  routes = M.Routing(jnp.asarray(probs)[None, :, None], jnp.asarray(experts)[None, :, None])
  mask = jnp.asarray([[1, 1, 0]])
  f = np.array([0.5, 0.5, 0.0])
  p = probs[:2].mean(0)
  np.testing.assert_allclose(float(load_balancing_loss(routes, mask)), 3 * f @ p, rtol=1e-6)
  # Its gradient flows through the probabilities only, as 3 * f / (positions) each.
  g = jax.grad(lambda pr: load_balancing_loss(M.Routing(pr, routes.experts), mask))(routes.probs)
  np.testing.assert_allclose(np.asarray(g)[0, :2, 0], np.tile(3 * f / 2, (2, 1)), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g)[0, 2], 0.0)


def test_export_loads_in_transformers(tmp_path):
  config = M.ModelConfig(
    family="qwen3_moe", vocab_size=80, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, d_ff=64, qk_norm=True, n_experts=3, experts_per_token=2, moe_d_ff=24,
    norm_topk_prob=False, router_aux_loss_coef=0.01, tie_embeddings=True,
  )  # fmt: skip
  params = perturbed(M.init_params(config, jax.random.PRNGKey(3)), jax.random.PRNGKey(4))
  M.save_pretrained(params, config, str(tmp_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path), attn_implementation="eager"
  ).eval()
  assert type(model).__name__ == "Qwen3MoeForCausalLM"
  assert model.config.router_aux_loss_coef == 0.01 and not model.config.norm_topk_prob
  tokens = np.random.RandomState(5).randint(0, config.vocab_size, (2, 20))
  err = rel_err(M.forward(params, config, jnp.asarray(tokens)), hf_logits(model, tokens))
  assert err < TOL, f"exported: relative logit error {err:.2e}"
  config2, params2 = M.load_pretrained(str(tmp_path))
  assert config2 == config
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def _hf_cfg(**kw):
  cfg = transformers.AutoConfig.for_model("qwen3_moe", **HF_SHAPE, **MOE, num_experts_per_tok=2)
  cfg = cfg.to_dict()
  return dict(cfg, **kw)


@pytest.mark.parametrize("kw", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[1])])
def test_dense_layers_among_experts_are_refused(kw):
  with pytest.raises(ValueError, match=r"dense MLP layers among the mixture-of-experts"):
    config_from_hf(_hf_cfg(**kw))
  assert config_from_hf(_hf_cfg()).n_experts == 4


def test_config_errors():
  base = dict(family="qwen3_moe", qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=32)
  M.ModelConfig(**base)
  with pytest.raises(ValueError, match="experts_per_token must be between 1 and n_experts"):
    M.ModelConfig(**dict(base, experts_per_token=5))
  with pytest.raises(ValueError, match="n_experts and moe_d_ff must be >= 1"):
    M.ModelConfig(**dict(base, n_experts=0))
  with pytest.raises(ValueError, match="has a dense MLP: n_experts"):
    M.ModelConfig(family="qwen3", qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=8)
