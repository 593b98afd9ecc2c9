"""Parity with `transformers` (CPU torch, float32): load, forward, export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.models.io.hf_config import config_from_hf, config_to_hf
from jetrl.precision import get_recipe
from model_helpers import (
  HF_SHAPE,
  LLAMA3_SCALING,
  hf_logits,
  hf_model,
  perturbed,
  rel_err,
  tiny_config,
)

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4

# (family, transformers config overrides, what the case varies)
CASES = {
  "llama_gqa_llama3_rope": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
  "llama_mha_tied_wide_heads": (
    "llama",
    dict(num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
  ),
  "qwen2_mqa_tied_bias": (
    "qwen2",
    dict(num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True),
  ),
  "qwen3_gqa3_headdim24": (
    "qwen3",
    dict(num_attention_heads=6, num_key_value_heads=2, head_dim=24, rope_theta=1e6),
  ),
  "qwen3_mha_tied": (
    "qwen3",
    dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5),
  ),
  "mistral_gqa_window_covers_all": ("mistral", dict(sliding_window=256, rope_theta=1e6)),
}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
  family, overrides = CASES[request.param]
  model = hf_model(family, seed=len(request.param), **overrides)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(str(path))
  config, params = M.load_pretrained(str(path))
  return request.param, model, config, params


def test_config_read_from_checkpoint(loaded):
  name, model, config, params = loaded
  hf = model.config
  assert config.family == CASES[name][0]
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  assert (config.n_heads, config.n_kv_heads, config.head_dim) == (
    hf.num_attention_heads,
    hf.num_key_value_heads,
    head_dim,
  )
  assert config.tie_embeddings == hf.tie_word_embeddings
  assert ("lm_head" in params) == (not hf.tie_word_embeddings)
  if name == "llama_gqa_llama3_rope":
    assert config.rope_scaling == M.RopeScaling(8.0, 1.0, 4.0, 16)
    assert config.rope_theta == 500000.0


@pytest.mark.parametrize("precision", ["none", "fp32"])
def test_logits_match_transformers(loaded, precision):
  _, model, config, params = loaded
  tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 24))
  want = hf_logits(model, tokens)
  prec = None if precision == "none" else get_recipe("fp32").train
  got = M.forward(params, config, jnp.asarray(tokens, jnp.int32), precision=prec)
  assert got.dtype == jnp.float32 and got.shape == want.shape
  err = rel_err(got, want)
  assert err < TOL, f"relative logit error {err:.2e} vs transformers"


def test_padded_batch_matches_transformers(loaded):
  """Right padding via attention_mask, and left padding with explicit positions."""
  _, model, config, params = loaded
  rng = np.random.RandomState(2)
  t = 16
  lengths = np.array([16, 11, 5])
  tokens = rng.randint(0, config.vocab_size, (3, t))
  right = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
  want = hf_logits(model, tokens, attention_mask=right)
  got = M.forward(params, config, jnp.asarray(tokens, jnp.int32), attention_mask=jnp.asarray(right))
  err = rel_err(got, want, where=right)
  assert err < TOL, f"right-padded batch: relative logit error {err:.2e}"

  left = right[:, ::-1].copy()
  positions = np.maximum(np.cumsum(left, axis=1) - 1, 0)
  want = hf_logits(model, tokens, attention_mask=left, position_ids=positions)
  got = M.forward(
    params,
    config,
    jnp.asarray(tokens, jnp.int32),
    attention_mask=jnp.asarray(left),
    positions=jnp.asarray(positions),
  )
  err = rel_err(got, want, where=left)
  assert err < TOL, f"left-padded batch: relative logit error {err:.2e}"
  # A left-padded row equals the same row without padding.
  row = 2
  alone = M.forward(params, config, jnp.asarray(tokens[row : row + 1, t - lengths[row] :]))
  err = rel_err(np.asarray(got)[row, t - lengths[row] :], alone[0])
  assert err < TOL, f"left-padded row vs unpadded row: {err:.2e}"


# What each family's export case varies, over a common small shape; a family without an entry
# (a new one) is exported with the common shape as it is.
EXPORT_VARIANTS = {
  "llama": dict(rope_theta=500000.0, rope_scaling=M.RopeScaling(8.0, 1.0, 4.0, 16), rms_eps=1e-5),
  "qwen2": dict(heads=(4, 1, 16), rope_theta=1e6, tie_embeddings=True),
  "qwen3": dict(heads=(4, 2, 20), rope_theta=1e6),
  "qwen3_moe": dict(n_experts=4, experts_per_token=2, moe_d_ff=32, norm_topk_prob=True),
}


def export_config(family: str) -> M.ModelConfig:
  fields = {"vocab": 80, "d_model": 48, "heads": (4, 2, 16), "d_ff": 64}
  return tiny_config(family, **{**fields, **EXPORT_VARIANTS.get(family, {})})


@pytest.mark.parametrize("family", list(M.SPECS))
def test_export_loads_in_transformers(family, tmp_path):
  config = export_config(family)
  params = perturbed(M.init_params(config, jax.random.PRNGKey(3)), jax.random.PRNGKey(4))
  M.save_pretrained(params, config, str(tmp_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path), attn_implementation="eager"
  ).eval()
  assert type(model).__name__ in M.ARCHITECTURES
  assert M.ARCHITECTURES[type(model).__name__] == family
  tokens = np.random.RandomState(5).randint(0, config.vocab_size, (2, 20))
  want = hf_logits(model, tokens)
  got = M.forward(params, config, jnp.asarray(tokens, jnp.int32))
  err = rel_err(got, want)
  assert err < TOL, f"exported {family}: relative logit error {err:.2e}"
  # And back: the same config and bit-identical params.
  config2, params2 = M.load_pretrained(str(tmp_path))
  assert config2 == config
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("window", [None, 256, 4096])
def test_mistral_window_that_covers_every_position_is_read(window):
  cfg = dict(transformers.AutoConfig.for_model("mistral", **HF_SHAPE).to_dict())
  cfg["sliding_window"] = window
  assert config_from_hf(cfg) == config_from_hf(dict(cfg, sliding_window=None))
  assert config_from_hf(cfg).max_seq_len == 256


def test_mistral_window_shorter_than_the_positions_is_refused():
  cfg = dict(transformers.AutoConfig.for_model("mistral", **HF_SHAPE).to_dict())
  cfg["sliding_window"] = 255
  with pytest.raises(ValueError, match=r"^config\.json: sliding_window=255 < max_position_emb"):
    config_from_hf(cfg)


def test_bf16_export_round_trip(tmp_path):
  config = export_config("qwen2")
  params = M.init_params(config, jax.random.PRNGKey(6), dtype=jnp.bfloat16)
  M.save_pretrained(params, config, str(tmp_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert str(next(model.parameters()).dtype) == "torch.bfloat16"
  embed = model.get_input_embeddings().weight.float().detach().numpy()
  np.testing.assert_array_equal(embed, np.asarray(params["embed"], np.float32))
  wq0 = model.model.layers[0].self_attn.q_proj.weight.float().detach().numpy()
  np.testing.assert_array_equal(wq0, np.asarray(params["layers"]["wq"][0], np.float32).T)
  _, loaded = M.load_pretrained(str(tmp_path), dtype=jnp.bfloat16)
  assert loaded["embed"].dtype == jnp.bfloat16
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, params)
  _, as_f32 = M.load_pretrained(str(tmp_path))
  assert as_f32["embed"].dtype == jnp.float32


def test_sharded_checkpoint(tmp_path):
  model = hf_model("qwen3", seed=7)
  model.save_pretrained(str(tmp_path), max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  config, params = M.load_pretrained(str(tmp_path))
  tokens = np.random.RandomState(8).randint(0, config.vocab_size, (1, 12))
  err = rel_err(M.forward(params, config, jnp.asarray(tokens)), hf_logits(model, tokens))
  assert err < TOL, f"sharded checkpoint: relative logit error {err:.2e}"


# Published parameter counts of the released checkpoints.
PUBLISHED = {
  "llama-3.1-8b": 8_030_261_248,
  "qwen2.5-7b": 7_615_616_512,
  "qwen2.5-0.5b": 494_032_768,
}


def test_published_param_counts():
  for name, n in PUBLISHED.items():
    assert M.get_config(name).n_params == n, name


def test_preset_shapes_match_transformers():
  """Each preset, written as a HF config, builds a transformers model (on the meta device)
  whose tensors have exactly the shapes and count the params layout says."""
  import torch  # pylint: disable=import-outside-toplevel

  for name, config in M.PRESETS.items():
    hf_cfg = config_to_hf(config, jnp.bfloat16)
    assert config_from_hf(hf_cfg) == config, name
    cfg = transformers.AutoConfig.for_model(
      **{k: v for k, v in hf_cfg.items() if k != "architectures"}
    )
    with torch.device("meta"):
      model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == config.n_params, (
      f"{name}: transformers has {n} params, config says {config.n_params}"
    )
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = M.param_shapes(config)
    assert state["model.layers.0.self_attn.q_proj.weight"] == shapes["layers"]["wq"][:0:-1]
    if config.moe:  # experts [E, D, Fe] as transformers stores them; the router [E, D]
      _, e, fe, d = shapes["layers"]["experts_down"]
      assert state["model.layers.0.mlp.experts.down_proj"] == (e, d, fe)
      assert state["model.layers.0.mlp.gate.weight"] == shapes["layers"]["router"][:0:-1]
    else:
      assert state["model.layers.0.mlp.down_proj.weight"] == shapes["layers"]["w_down"][:0:-1]
    assert state["model.embed_tokens.weight"] == shapes["embed"]
