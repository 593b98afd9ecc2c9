"""Every kind of tokenizer (the character tokenizer, a checkpoint's over `tokenizers`, a
`transformers` one) satisfies `jetrl.data.Tokenizer` and behaves the same through it: encode /
decode, stop ids, chat prompt ids (or the clear error), save_pretrained read back by
`transformers`. Expected ids are worked out by hand from the vocabularies below."""

from __future__ import annotations

import json

import pytest
from conftest import CHATML_TEMPLATE

from jetrl.data import Tokenizer, char_tokenizer, chat_prompt_ids, stop_token_ids

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

WORDS = ["[UNK]", "user", "assistant", "system", "hello", "world", "you", "are", "kind", "!"]
IM_START, IM_END, ENDOFTEXT = 10, 11, 12
TEMPLATE = CHATML_TEMPLATE
# The template on "hello" (no system prompt: the template's default system turn), by hand.
CHAT_HELLO = [IM_START, 3, 6, 7, 8, IM_END, IM_START, 1, 4, IM_END, IM_START, 2]
# With system prompt "kind !": that turn replaces the default.
CHAT_SYSTEM = [IM_START, 3, 8, 9, IM_END, IM_START, 1, 4, IM_END, IM_START, 2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  backend = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # words, spaced
  backend.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
      }
    )
  )
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
  return path


def _tokenizer(kind, folder):
  from jetrl.models import HFTokenizer, load_tokenizer

  if kind == "char":
    return char_tokenizer()
  if kind == "tokenizers":
    return load_tokenizer(str(folder))
  if kind == "tokenizers_in_memory":  # built without a folder: save_pretrained writes files
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return HFTokenizer(
      backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
    )
  return transformers.AutoTokenizer.from_pretrained(str(folder))


KINDS = ["char", "tokenizers", "tokenizers_in_memory", "transformers"]
# (text, its ids without special tokens, with them), by hand.
TEXTS = {
  "char": ("12+3=15\n", [6, 7, 15, 8, 19, 6, 10, 3], [1, 6, 7, 15, 8, 19, 6, 10, 3]),
  "words": ("hello world !", [4, 5, 9], [4, 5, 9]),  # no bos in this vocabulary
}
STOPS = {
  "char": (2,),
  "tokenizers": (IM_END, ENDOFTEXT),  # eos, then generation_config.json's
  "tokenizers_in_memory": (IM_END,),
  "transformers": (IM_END,),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_satisfies_the_protocol(kind, folder):
  tok = _tokenizer(kind, folder)
  assert isinstance(tok, Tokenizer)
  text, bare, full = TEXTS["char" if kind == "char" else "words"]
  assert tok.encode(text, add_special_tokens=False) == bare
  assert tok.encode(text) == full
  assert tok.decode(bare) == text
  assert stop_token_ids(tok) == STOPS[kind]
  assert len(tok) == (53 if kind == "char" else len(WORDS) + 3)


@pytest.mark.parametrize("kind", KINDS)
def test_chat_prompt_ids_or_the_clear_error(kind, folder):
  tok = _tokenizer(kind, folder)
  if kind == "char":
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="the character tokenizer has no chat template"):
      tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(ValueError, match="needs a checkpoint tokenizer with a chat template"):
      chat_prompt_ids(tok, "1+1")
    return
  assert tok.chat_template == TEMPLATE
  assert chat_prompt_ids(tok, "hello") == CHAT_HELLO
  assert chat_prompt_ids(tok, "hello", system_prompt="kind !") == CHAT_SYSTEM


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_reads_back_in_transformers(kind, folder, tmp_path):
  tok = _tokenizer(kind, folder)
  tok.save_pretrained(str(tmp_path / "out"))
  back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  text, _, full = TEXTS["char" if kind == "char" else "words"]
  assert back(text)["input_ids"] == full
  assert back.eos_token_id == (2 if kind == "char" else IM_END)
  assert back.pad_token_id == (0 if kind == "char" else ENDOFTEXT)
  assert back.chat_template == (None if kind == "char" else TEMPLATE)
  # generation_config.json belongs to the model: the export writes it, not the tokenizer.
  assert not (tmp_path / "out" / "generation_config.json").exists()
