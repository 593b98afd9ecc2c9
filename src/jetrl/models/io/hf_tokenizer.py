"""Tokenizer loading from a Hugging Face checkpoint directory (the `tokenizers` library).

`load_tokenizer(path)` reads tokenizer.json, the special tokens of tokenizer_config.json, the
chat template (from tokenizer_config.json, chat_template.jinja or chat_template.json) and the
end-of-generation ids of generation_config.json, as an `HFTokenizer` (a
`jetrl.data.Tokenizer`, like the character tokenizer and `transformers` tokenizers).
`load_model_tokenizer(model, tokenizer)` is what a run uses: the tokenizer of one folder (the
model's, or a separate tokenizer folder), with the end-of-generation ids of both, so that
sampling stops on every id the model's generation config names, not only on the eos token
(`stop_ids`). `HFTokenizer.save_pretrained(dir)` writes the tokenizer's files back out.
Chat templates are rendered with jinja2 in a sandbox, the way `transformers` renders them, in a
worker process with time and memory limits (`jetrl.models.io.chat_render`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional, Sequence

from jetrl.data.tokenizer import Tokenizer, stop_token_ids
from jetrl.models.io.chat_render import TemplateRenderer
from jetrl.models.config import ModelConfig
from jetrl.models.io.hf_io import TOKENIZER_FILES, resolve_path


def _token_text(value) -> Optional[str]:
  if isinstance(value, dict):
    return value.get("content")
  return value


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _chat_template(path: str, tok_cfg: dict) -> Optional[str]:
  jinja_file = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja_file):
    with open(jinja_file) as f:
      return f.read()
  template = tok_cfg.get("chat_template") or _read_json(
    os.path.join(path, "chat_template.json")
  ).get("chat_template")
  if isinstance(template, list):  # named templates: take "default"
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default") or next(iter(named.values()), None)
  return template


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the checkpoint's special tokens and chat template.

  source: the folder its files were read from (`load_tokenizer`), which `save_pretrained`
    copies; None for one built in memory.
  """

  def __init__(
    self,
    backend,
    *,
    bos_token=None,
    eos_token=None,
    pad_token=None,
    chat_template: Optional[str] = None,
    extra_eos_ids: Sequence[int] = (),
    source: Optional[str] = None,
  ):
    self.backend = backend
    self.extra_eos_ids = tuple(int(i) for i in extra_eos_ids)
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.chat_template = chat_template
    self.source = source
    self._compiled = None

  def _id(self, token):
    return None if token is None else self.backend.token_to_id(token)

  @property
  def bos_token_id(self) -> Optional[int]:
    return self._id(self.bos_token)

  @property
  def eos_token_id(self) -> Optional[int]:
    return self._id(self.eos_token)

  @property
  def eos_token_ids(self) -> tuple:
    """Every id that ends a generation: the eos token and generation_config.json's eos ids."""
    ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + list(self.extra_eos_ids)
    return tuple(dict.fromkeys(ids))

  @property
  def pad_token_id(self) -> Optional[int]:
    return self._id(self.pad_token)

  def __len__(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def vocab_size(self) -> int:
    return len(self)

  def encode(self, text: str, add_special_tokens: bool = True) -> list:
    """Token ids of `text` (add_special_tokens as in `transformers`; text rendered by a chat
    template already holds its special tokens: pass False, or use `encode_chat`)."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
    self, messages, *, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
  ):
    """The chat template rendered for `messages` ([{"role": ..., "content": ...}, ...]): the
    text, or with `tokenize` its ids (`encode_chat`). Other keywords reach the template."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    if self._compiled is None:
      self._compiled = TemplateRenderer(self.chat_template)
    text = self._compiled.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
      pad_token=self.pad_token or "",
      **kwargs,
    )
    return self.encode(text, add_special_tokens=False) if tokenize else text

  def encode_chat(self, messages, *, add_generation_prompt: bool = True, **kwargs) -> list:
    """Token ids of the rendered chat template (no special tokens added on top)."""
    return self.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )

  def save_pretrained(self, directory: str) -> tuple:
    """The tokenizer's files in `directory`, for `transformers` to read: those of `source`
    copied as they are (every tokenizer file but generation_config.json, which belongs to the
    model), or, for a tokenizer built in memory, tokenizer.json and a tokenizer_config.json
    with its special tokens and chat template. Returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    written = []
    if self.source is not None:
      for name in TOKENIZER_FILES:
        src = os.path.join(self.source, name)
        if name != "generation_config.json" and os.path.isfile(src):
          written.append(shutil.copy(src, os.path.join(directory, name)))
      return tuple(written)
    path = os.path.join(directory, "tokenizer.json")
    self.backend.save(path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos_token", "eos_token", "pad_token"):
      if getattr(self, name) is not None:
        config[name] = getattr(self, name)
    if self.chat_template:
      config["chat_template"] = self.chat_template
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path, "w", encoding="utf-8") as f:
      json.dump(config, f, ensure_ascii=False, indent=1)
    return (path, config_path)


def check_vocab(config: ModelConfig, tokenizer: Tokenizer) -> None:
  """ValueError when the tokenizer has ids the model's embedding cannot hold: more tokens than
  config.vocab_size, or a bos / eos / pad / end-of-generation id outside it."""
  named = {
    "tokenizer size - 1": len(tokenizer) - 1,
    "bos id": tokenizer.bos_token_id,
    "eos id": tokenizer.eos_token_id,
    "pad id": tokenizer.pad_token_id,
  }
  named.update({f"end-of-generation id #{k}": i for k, i in enumerate(stop_token_ids(tokenizer))})
  bad = {
    k: int(v) for k, v in named.items() if v is not None and not 0 <= int(v) < config.vocab_size
  }
  if bad:
    listing = ", ".join(f"{k} {v}" for k, v in bad.items())
    raise ValueError(
      f"the tokenizer does not fit the model: {listing} not in [0, vocab_size={config.vocab_size})"
    )


def _eos_list(path: str, file: str) -> Optional[list]:
  """The `eos_token_id` (an int or a list of ints) of `path/file` as a list; None when the
  file or the key is absent. A malformed value is a ValueError naming the file."""
  full = os.path.join(path, file)
  if not os.path.exists(full):
    return None
  try:
    data = _read_json(full)
  except ValueError as e:
    raise ValueError(f"{full}: not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{full}: expected a JSON object")
  value = data.get("eos_token_id")
  if value is None:
    return None
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(
      f"{full}: eos_token_id must be a non-negative int or a list of them, got {value!r}"
    )
  return list(values)


def generation_eos_ids(path: str) -> tuple:
  """The end-of-generation ids a checkpoint folder declares: generation_config.json's
  `eos_token_id` (an int or a list), or, when that file is absent, config.json's (what
  `transformers` generate falls back to). () when neither names any."""
  gen = _eos_list(path, "generation_config.json")
  if gen is None and not os.path.exists(os.path.join(path, "generation_config.json")):
    gen = _eos_list(path, "config.json")
  return tuple(gen or ())


def stop_ids(tokenizer: Tokenizer) -> tuple:
  """Every token id that ends a sample (`SamplingConfig.stop_ids`): `stop_token_ids`, and a
  ValueError when there is none."""
  ids = stop_token_ids(tokenizer)
  if not ids:
    raise ValueError(
      "the tokenizer has no eos token and its folders name no eos_token_id: "
      "sampling could never stop on a token"
    )
  return tuple(int(i) for i in ids)


def load_model_tokenizer(
  model: str, tokenizer: Optional[str] = None, *, config: Optional[ModelConfig] = None
) -> HFTokenizer:
  """The tokenizer a run uses with the checkpoint folder `model`.

  tokenizer: a folder (or hub name) with tokenizer.json to use instead of the model's own
    (its special tokens and chat template come with it); None: the model folder's.
  The end-of-generation ids are those of the tokenizer folder and of the model folder
  (`generation_eos_ids`): the model's generation config decides when its samples end, even
  when the tokenizer comes from elsewhere. Checked against `config` when given.
  """
  model = resolve_path(model)
  tok = load_tokenizer(tokenizer if tokenizer else model)
  extra = list(tok.extra_eos_ids) + list(generation_eos_ids(model))
  tok.extra_eos_ids = tuple(dict.fromkeys(extra))
  if config is not None:
    check_vocab(config, tok)
  return tok


def load_tokenizer(path: str, *, config: Optional[ModelConfig] = None) -> HFTokenizer:
  """The tokenizer of a checkpoint directory (or hub name); checks it against `config`."""
  from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel

  path = resolve_path(path)
  tok_file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tok_file):
    raise ValueError(f"{path}: tokenizer.json not found (a fast tokenizer file is required)")
  tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
  special = _read_json(os.path.join(path, "special_tokens_map.json"))

  def token(name):
    return _token_text(tok_cfg.get(name)) or _token_text(special.get(name))

  gen_eos = _eos_list(path, "generation_config.json") or []
  tok = HFTokenizer(
    Backend.from_file(tok_file),
    bos_token=token("bos_token"),
    eos_token=token("eos_token"),
    pad_token=token("pad_token"),
    chat_template=_chat_template(path, tok_cfg),
    extra_eos_ids=gen_eos,
    source=path,
  )
  if config is not None:
    check_vocab(config, tok)
  return tok
