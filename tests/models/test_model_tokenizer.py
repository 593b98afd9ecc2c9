"""load_tokenizer: special tokens and chat template, checked against `transformers`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import CHATML_TEMPLATE

from jetrl import models as M
from jetrl.config import FlagError
from jetrl.data import Tokenizer, char_tokenizer
from jetrl.data.prompts import chat_prompt_ids
from jetrl.train import ModelSpec, pieces, run, run_sft

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [
  "[UNK]",
  "user",
  "assistant",
  "system",
  "hello",
  "world",
  "you",
  "are",
  "kind",
  "!",
  "2",
  "+",
  "=",
  "4",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = CHATML_TEMPLATE
MESSAGES = [
  {"role": "user", "content": "hello world !"},
  {"role": "assistant", "content": "2 + 2 = 4"},
  {"role": "user", "content": "hello"},
]


def _write(path, template_in_file=False):
  backend = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens(SPECIALS)
  backend.save(str(path / "tokenizer.json"))
  cfg = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
  }
  if template_in_file:
    (path / "chat_template.jinja").write_text(TEMPLATE)
  else:
    cfg["chat_template"] = TEMPLATE
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return len(WORDS) + len(SPECIALS)


@pytest.mark.parametrize("template_in_file", [False, True])
def test_matches_transformers(tmp_path, template_in_file):
  n = _write(tmp_path, template_in_file)
  ours = M.load_tokenizer(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert len(ours) == len(ref) == n
  assert ours.eos_token_id == ref.eos_token_id == len(WORDS) + 1
  assert ours.pad_token_id == ref.pad_token_id
  assert ours.bos_token_id is None
  for gen in (True, False):
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
  ids = ours.encode_chat(MESSAGES)
  ref_ids = ref.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
  if hasattr(ref_ids, "keys"):  # a BatchEncoding in recent transformers
    ref_ids = ref_ids["input_ids"]
  assert ids == list(ref_ids)
  assert ours.decode(ours.encode("hello world")) == ref.decode(ref.encode("hello world"))


def test_special_tokens_as_dicts(tmp_path):
  _write(tmp_path)
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  cfg["eos_token"] = {"content": "<|endoftext|>", "special": True}
  del cfg["pad_token"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  (tmp_path / "special_tokens_map.json").write_text(
    json.dumps({"pad_token": {"content": "<|im_start|>"}})
  )
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 16]}))
  tok = M.load_tokenizer(str(tmp_path))
  assert tok.eos_token_id == len(WORDS) + 2
  assert tok.pad_token_id == len(WORDS)
  assert tok.eos_token_ids == (16, 3)


def test_vocab_must_fit_the_model(tmp_path):
  n = _write(tmp_path)
  config = M.ModelConfig(
    vocab_size=n - 1, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32
  )
  with pytest.raises(ValueError, match="vocab"):
    M.load_tokenizer(str(tmp_path), config=config)
  bigger = M.ModelConfig(
    vocab_size=n + 10, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32
  )
  assert len(M.load_tokenizer(str(tmp_path), config=bigger)) == n  # padded embeddings are fine


def test_special_ids_must_fit_the_model(tmp_path):
  n = _write(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [n - 2, n + 7]}))
  config = M.ModelConfig(
    vocab_size=n + 2, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32
  )
  with pytest.raises(
    ValueError,
    match=f"does not fit the model: end-of-generation id #1 "
    f"{n + 7} not in \\[0, vocab_size={n + 2}\\)",
  ):
    M.load_tokenizer(str(tmp_path), config=config)
  tok = M.load_tokenizer(str(tmp_path))  # the training path loads it without a config
  assert pieces.token_ids(tok).stop == (n - 2, n + 7) and isinstance(tok, Tokenizer)
  with pytest.raises(ValueError, match=f"--model.name: .*end-of-generation id #1 {n + 7}"):
    pieces.check_tokenizer(config, tok)
  # A tokenizer given by --model.tokenizer is what the error names then.
  spec = ModelSpec(name=str(tmp_path), tokenizer=str(tmp_path))
  with pytest.raises(ValueError, match=f"--model.tokenizer: .*end-of-generation id #1 {n + 7}"):
    pieces.check_tokenizer(config, tok, spec)
  pieces.check_tokenizer(dataclasses.replace(config, vocab_size=n + 8), tok, spec)


def test_missing_tokenizer_file(tmp_path):
  with pytest.raises(ValueError, match="tokenizer.json"):
    M.load_tokenizer(str(tmp_path))


def test_no_chat_template(tmp_path):
  _write(tmp_path)
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del cfg["chat_template"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  tok = M.load_tokenizer(str(tmp_path))
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="chat template"):
    tok.apply_chat_template(MESSAGES)
  with pytest.raises(ValueError, match="needs a checkpoint tokenizer with a chat template"):
    chat_prompt_ids(tok, "hello")


# ---------------------------------------------------------------------------- stop ids

IM_END, ENDOFTEXT = len(WORDS) + 1, len(WORDS) + 2


def test_stop_ids_gather_every_eos(tmp_path):
  """The eos token, then every eos id of the tokenizer's and the model's generation configs."""
  tok_dir, model_dir = tmp_path / "tok", tmp_path / "model"
  tok_dir.mkdir()
  model_dir.mkdir()
  _write(tok_dir)
  assert M.stop_ids(M.load_tokenizer(str(tok_dir))) == (IM_END,)
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
  (model_dir / "generation_config.json").write_text(
    json.dumps({"eos_token_id": [ENDOFTEXT, IM_END]})
  )
  tok = M.load_model_tokenizer(str(model_dir), str(tok_dir))
  assert M.stop_ids(tok) == (IM_END, 3, ENDOFTEXT)
  assert tok.chat_template == TEMPLATE  # the tokenizer folder's template
  # without generation_config.json, config.json's eos_token_id (transformers' fallback)
  (model_dir / "generation_config.json").unlink()
  (model_dir / "config.json").write_text(json.dumps({"eos_token_id": [ENDOFTEXT]}))
  assert M.stop_ids(M.load_model_tokenizer(str(model_dir), str(tok_dir))) == (IM_END, 3, ENDOFTEXT)
  # the model folder alone, when it holds the tokenizer too
  _write(model_dir)
  assert M.stop_ids(M.load_model_tokenizer(str(model_dir))) == (IM_END, ENDOFTEXT)
  assert M.stop_ids(char_tokenizer()) == (2,)


@pytest.mark.parametrize("value", ["2", [1, -1], True, [1.5]])
def test_malformed_eos_ids_name_the_file(tmp_path, value):
  _write(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
  with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
    M.load_tokenizer(str(tmp_path))


def test_model_eos_ids_are_checked_against_the_model(tmp_path):
  n = _write(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": n + 3}))
  config = M.ModelConfig(
    vocab_size=n, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32
  )
  with pytest.raises(ValueError, match=f"end-of-generation id #1 {n + 3} not in"):
    M.load_model_tokenizer(str(tmp_path), config=config)


def test_a_run_refuses_a_tokenizer_whose_ids_exceed_the_models_vocab(
  tmp_path, tiny_train_config, tiny_sft_config
):
  """Through `run()` and `run_sft()`: the preset is sized to the tokenizer (n ids), whose
  generation config names an end-of-generation id n + 7 that the embedding does not have."""
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  n = _write(tok_dir)
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [n - 2, n + 7]}))
  message = (
    f"^--model.tokenizer: .*end-of-generation id #1 {n + 7} not in \\[0, vocab_size={n}\\); "
    "the tokenizer must fit the model of --model.name"
  )
  for make, entry in ((tiny_train_config, run), (tiny_sft_config, run_sft)):
    cfg = make(tmp_path / entry.__name__, model={"tokenizer": str(tok_dir)})
    with pytest.raises(FlagError, match=message):
      entry(cfg, log=lambda *a: None)
    assert not (tmp_path / entry.__name__ / "checkpoints").exists()
