"""ModelConfig, presets and the params layout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jetrl import models as M
from jetrl.models.io.hf_config import config_from_hf, config_to_hf
from model_helpers import tiny_config

REAL = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "llama-3.1-8b")


def test_presets_exist_and_are_hashable():
  assert set(REAL) | {"tiny"} <= set(M.PRESETS)
  for name, config in M.PRESETS.items():
    assert M.get_config(name) is config
    hash(config)
  assert M.get_config("Qwen3-8B") is M.PRESETS["qwen3-8b"]
  assert hash(M.get_config("tiny")) == hash(dataclasses.replace(M.get_config("tiny")))


def test_tiny_is_fp8_block_friendly():
  c = M.get_config("tiny")
  for name, shape in M.param_shapes(c)["layers"].items():
    if name.startswith("w"):
      k, n = shape[1:]
      assert k % 128 == 0 and n % 128 == 0, (name, shape)
      assert (k // 128) * (n // 128) >= 2, (name, shape)
  small = dataclasses.replace(c, vocab_size=40)
  assert small.vocab_size == 40 and M.param_shapes(small)["embed"] == (40, c.d_model)


def test_real_shapes():
  llama = M.get_config("llama-3.1-8b")
  assert llama.rope_scaling == M.RopeScaling(8.0, 1.0, 4.0, 8192)
  assert (llama.n_kv_heads, llama.rope_theta, llama.rms_eps) == (8, 500000.0, 1e-5)
  q3 = M.get_config("qwen3-0.6b")
  assert q3.qk_norm and q3.tie_embeddings and q3.q_dim == 2048 != q3.d_model
  q25 = M.get_config("qwen2.5-7b")
  assert q25.qkv_bias and not q25.tie_embeddings and q25.vocab_size == 152064


def test_unknown_preset_lists_known_ones():
  with pytest.raises(ValueError, match="qwen3-8b"):
    M.get_config("gpt-5")


@pytest.mark.parametrize(
  "field,value",
  [
    ("family", "gpt2"),
    ("n_kv_heads", 3),
    ("d_model", 0),
    ("head_dim", 7),
    ("rope_theta", -1.0),
    ("rope_scaling", {"factor": 8}),
  ],
)
def test_bad_config_fields(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(M.get_config("tiny"), **{field: value})


def test_init_params_layout():
  c = dataclasses.replace(
    M.get_config("tiny"), family="qwen2", qkv_bias=True, qk_norm=False, tie_embeddings=True
  )
  p = M.init_params(c, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
  assert "lm_head" not in p and "bq" in p["layers"] and "q_norm" not in p["layers"]
  assert p["layers"]["wq"].shape == (c.n_layers, c.d_model, c.q_dim)
  assert p["layers"]["w_down"].shape == (c.n_layers, c.d_ff, c.d_model)
  assert p["embed"].dtype == jnp.bfloat16
  n = sum(x.size for x in jax.tree_util.tree_leaves(p))
  assert n == c.n_params
  M.check_params(p, c)


@pytest.mark.parametrize("family", list(M.SPECS))
def test_every_family_round_trips_through_config_json(family):
  """Written from the spec and read back: by architecture, and by model_type alone."""
  spec = M.family_spec(family)
  config = tiny_config(family, vocab=64, d_model=32, heads=(2, 1, 16), d_ff=48)
  hf = config_to_hf(config, jnp.float32)
  assert hf["architectures"] == [spec.architecture] and hf["model_type"] == spec.model_type
  assert M.ARCHITECTURES[spec.architecture] == family
  assert config_from_hf(hf) == config
  assert config_from_hf(dict(hf, architectures=None)) == config
  with pytest.raises(ValueError, match="has no Hugging Face equivalent"):
    config_to_hf(dataclasses.replace(config, qkv_bias=not spec.qkv_bias), jnp.float32)


def test_family_spec_is_checked():
  with pytest.raises(ValueError, match="sliding_window 'sometimes' is not one of"):
    M.FamilySpec(name="x", architecture="XForCausalLM", model_type="x", sliding_window="sometimes")
  with pytest.raises(ValueError, match=r"unknown model family 'gpt2'; accepted: \['llama'"):
    M.family_spec("gpt2")
  assert M.FAMILIES == tuple(M.SPECS)
