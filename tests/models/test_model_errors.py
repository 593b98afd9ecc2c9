"""Bad input gives a ValueError that names the tensor or field."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jetrl import models as M
from model_helpers import tiny_config

CONFIG = tiny_config("qwen3", vocab=32, d_model=32, heads=(2, 1, 16), d_ff=48)


@pytest.fixture()
def ckpt(tmp_path):
  M.save_pretrained(M.init_params(CONFIG, jax.random.PRNGKey(0)), CONFIG, str(tmp_path))
  return tmp_path


def _edit_json(path, **changes):
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
  tensors = load_file(str(path / "model.safetensors"))
  fn(tensors)
  save_file(tensors, str(path / "model.safetensors"))


def _load_refused(ckpt, match, **kwargs):
  """load_pretrained(ckpt) raises a ValueError matching `match`."""
  with pytest.raises(ValueError, match=match):
    M.load_pretrained(str(ckpt), **kwargs)


def test_round_trip_is_ok(ckpt):
  config, _ = M.load_pretrained(str(ckpt))
  assert config == CONFIG


@pytest.mark.parametrize(
  "changes,match",
  [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None), "yarn"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
  ],
)
def test_unsupported_config(ckpt, changes, match):
  _edit_json(ckpt / "config.json", **changes)
  _load_refused(ckpt, match)


def test_missing_tensor(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
  _load_refused(ckpt, r"model\.layers\.1\.self_attn\.k_norm\.weight")


def test_misshaped_tensor(ckpt):
  def cut(t):
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

  _edit_tensors(ckpt, cut)
  _load_refused(ckpt, r"model\.layers\.0\.mlp\.up_proj\.weight.*\(47, 32\)")


def test_unexpected_tensor(ckpt):
  _edit_tensors(
    ckpt, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)})
  )
  _load_refused(ckpt, r"o_proj\.bias")


def test_vocab_disagrees_with_config(ckpt):
  _edit_json(ckpt / "config.json", vocab_size=33)
  _load_refused(ckpt, "embed_tokens")


def test_integer_tensor_is_refused_not_cast(ckpt):
  """An int8 tensor used to be cast to float silently (a quantized 0.011 became 11.0)."""

  def quantize(t):
    w = t["model.layers.0.mlp.up_proj.weight"]
    t["model.layers.0.mlp.up_proj.weight"] = np.round(w * 1000).astype(np.int8)

  _edit_tensors(ckpt, quantize)
  _load_refused(
    ckpt,
    r"'model\.layers\.0\.mlp\.up_proj\.weight' is stored "
    r"as I8; accepted: F32, BF16, F16, F64",
  )


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_tensor_is_refused(ckpt, value):
  def poison(t):
    t["model.layers.1.self_attn.o_proj.weight"][3, 4] = value

  _edit_tensors(ckpt, poison)
  _load_refused(
    ckpt,
    r"'model\.layers\.1\.self_attn\.o_proj\.weight' holds 1 "
    r"non-finite values",
  )


def test_f64_values_beyond_the_target_dtype_are_refused_not_cast_to_inf(ckpt):
  """Finite as stored, but above float32's largest value (3.4e38): the cast would make Inf."""
  name = "model.layers.0.self_attn.k_proj.weight"

  def widen(t, big):
    w = t[name].astype(np.float64)
    w[1, 2], w[0, 0] = big, -big
    t[name] = w

  _edit_tensors(ckpt, lambda t: widen(t, 1e39))
  _load_refused(
    ckpt,
    rf"'{re.escape(name)}' holds 2 values beyond the range of float32 \(largest "
    r"magnitude 1e\+39, stored as F64\); they would become Inf",
  )
  # bfloat16 has float32's range: the same values are refused when read into it too, and
  # values within the range (F64 1e38) are read as they are.
  _load_refused(ckpt, "beyond the range of bfloat16", dtype=jnp.bfloat16)
  _edit_tensors(ckpt, lambda t: widen(t, 1e38))
  _, params = M.load_pretrained(str(ckpt))
  k = np.asarray(params["layers"]["wk"][0])  # [in, out]: the stored [out, in] transposed
  assert k[2, 1] == np.float32(1e38) and k[0, 0] == np.float32(-1e38)


def test_missing_directory_or_files(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    M.load_pretrained(str(tmp_path / "nope"))
  with pytest.raises(ValueError, match="config.json"):
    M.load_pretrained(str(tmp_path))
  (tmp_path / "config.json").write_text(
    json.dumps(
      {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
      }
    )
  )
  with pytest.raises(ValueError, match="model.safetensors"):
    M.load_pretrained(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
  with pytest.raises(ValueError, match="vocab_size"):
    M.load_pretrained(str(tmp_path))


def test_export_needs_a_hf_equivalent(tmp_path):
  bad = tiny_config(
    "llama", vocab=32, d_model=32, heads=(2, 1, 16), d_ff=48, n_layers=1, qkv_bias=True
  )
  with pytest.raises(ValueError, match="qkv_bias"):
    M.save_pretrained(M.init_params(bad, jax.random.PRNGKey(0)), bad, str(tmp_path))


def test_params_that_do_not_fit_the_config():
  params = M.init_params(CONFIG, jax.random.PRNGKey(0))
  tokens = jnp.zeros((1, 4), jnp.int32)
  other = dataclasses.replace(CONFIG, d_ff=64)
  with pytest.raises(ValueError, match=r"w_gate"):
    M.forward(params, other, tokens)
  with pytest.raises(ValueError, match="q_norm"):
    M.forward(params, dataclasses.replace(CONFIG, qk_norm=False), tokens)


def test_bad_call_arguments():
  params = M.init_params(CONFIG, jax.random.PRNGKey(0))
  tokens = jnp.zeros((2, 4), jnp.int32)
  with pytest.raises(ValueError, match="tokens"):
    M.forward(params, CONFIG, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="positions"):
    M.forward(params, CONFIG, tokens, positions=jnp.zeros((2, 5), jnp.int32))
  with pytest.raises(ValueError, match="attention_mask"):
    M.forward(params, CONFIG, tokens, attention_mask=jnp.ones((1, 4)))
  with pytest.raises(ValueError, match="chunk_size"):
    M.token_logprobs(params, CONFIG, tokens, tokens, chunk_size=0)
  with pytest.raises(ValueError, match="targets"):
    M.token_logprobs(params, CONFIG, tokens, tokens[:, :3])
  with pytest.raises(ValueError, match="temperature"):
    M.token_logprobs(params, CONFIG, tokens, tokens, temperature=0.0)
  cache = M.init_cache(CONFIG, 3, 8, jnp.float32)
  kw = dict(positions=jnp.zeros((2, 4), jnp.int32), token_mask=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match="cache"):
    M.forward_cached(params, CONFIG, tokens, cache, **kw)
  with pytest.raises(ValueError, match="do not fit"):
    M.forward_cached(params, CONFIG, tokens, M.init_cache(CONFIG, 2, 3, jnp.float32), **kw)
  with pytest.raises(ValueError, match="token_mask"):
    M.forward_cached(
      params,
      CONFIG,
      tokens,
      M.init_cache(CONFIG, 2, 8, jnp.float32),
      positions=kw["positions"],
      token_mask=jnp.ones((2, 3), bool),
    )
  for slots in (3, 9):
    with pytest.raises(
      ValueError, match="attend_slots must be between the 4 new tokens and the cache's 8 slots"
    ):
      M.forward_cached(
        params, CONFIG, tokens, M.init_cache(CONFIG, 2, 8, jnp.float32), attend_slots=slots, **kw
      )
  with pytest.raises(ValueError, match="max_len"):
    M.init_cache(CONFIG, 2, 0)


def test_hub_name_goes_through_snapshot_download(ckpt, monkeypatch):
  huggingface_hub = pytest.importorskip("huggingface_hub")
  seen = {}

  def fake(repo_id, **kwargs):
    seen["repo_id"] = repo_id
    return str(ckpt)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
  config, _ = M.load_pretrained("Org/tiny-model")
  assert seen["repo_id"] == "Org/tiny-model" and config == CONFIG

  def offline(repo_id, **kwargs):
    raise OSError("hub unreachable")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
  with pytest.raises(ValueError, match="hub unreachable"):
    M.load_pretrained("Org/tiny-model")
