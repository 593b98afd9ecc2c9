"""Tokenizer loading from a Hugging Face checkpoint directory (the `tokenizers` library).

`load_tokenizer(path)` reads tokenizer.json, the special tokens of tokenizer_config.json, the
chat template (from tokenizer_config.json, chat_template.jinja or chat_template.json) and the
end-of-generation ids of generation_config.json, as an `HFTokenizer` (a
`jetrl.data.Tokenizer`, like the character tokenizer and `transformers` tokenizers).
Chat templates are rendered with jinja2 in a sandbox, the way `transformers` renders them.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Optional, Sequence

from jetrl.data.tokenizer import Tokenizer, stop_token_ids
from jetrl.models.config import ModelConfig


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
      os.path.join(path, "chat_template.json")).get("chat_template")
  if isinstance(template, list):  # named templates: take "default"
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default") or next(iter(named.values()), None)
  return template


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the checkpoint's special tokens and chat template."""

  def __init__(self, backend, *, bos_token=None, eos_token=None, pad_token=None,
               chat_template: Optional[str] = None, extra_eos_ids: Sequence[int] = ()):
    self.backend = backend
    self.extra_eos_ids = tuple(int(i) for i in extra_eos_ids)
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.chat_template = chat_template
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

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """The chat template rendered for `messages` ([{"role": ..., "content": ...}, ...])."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    if self._compiled is None:
      self._compiled = _compile(self.chat_template)
    return self._compiled.render(messages=list(messages),
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                 pad_token=self.pad_token or "", **kwargs)

  def encode_chat(self, messages, *, add_generation_prompt: bool = True, **kwargs) -> list:
    """Token ids of the rendered chat template (no special tokens added on top)."""
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                    **kwargs)
    return self.encode(text, add_special_tokens=False)


def _compile(template: str):
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
    from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("rendering a chat template needs jinja2 (pip install jinja2)") from e

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(template)


def check_vocab(config: ModelConfig, tokenizer: Tokenizer) -> None:
  """ValueError when the tokenizer has ids the model's embedding cannot hold: more tokens than
  config.vocab_size, or a bos / eos / pad / end-of-generation id outside it."""
  named = {"tokenizer size - 1": len(tokenizer) - 1, "bos id": tokenizer.bos_token_id,
           "eos id": tokenizer.eos_token_id, "pad id": tokenizer.pad_token_id}
  named.update({f"end-of-generation id #{k}": i
                for k, i in enumerate(stop_token_ids(tokenizer))})
  bad = {k: int(v) for k, v in named.items()
         if v is not None and not 0 <= int(v) < config.vocab_size}
  if bad:
    listing = ", ".join(f"{k} {v}" for k, v in bad.items())
    raise ValueError(f"the tokenizer does not fit the model: {listing} not in [0, "
                     f"vocab_size={config.vocab_size})")


def load_tokenizer(path: str, *, config: Optional[ModelConfig] = None) -> HFTokenizer:
  """The tokenizer of a checkpoint directory (or hub name); checks it against `config`."""
  from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel

  from jetrl.models.hf_io import resolve_path  # pylint: disable=import-outside-toplevel
  path = resolve_path(path)
  tok_file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(tok_file):
    raise ValueError(f"{path}: tokenizer.json not found (a fast tokenizer file is required)")
  tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
  special = _read_json(os.path.join(path, "special_tokens_map.json"))

  def token(name):
    return _token_text(tok_cfg.get(name)) or _token_text(special.get(name))

  gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
  gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else gen_eos
  tok = HFTokenizer(Backend.from_file(tok_file), bos_token=token("bos_token"),
                  eos_token=token("eos_token"), pad_token=token("pad_token"),
                  chat_template=_chat_template(path, tok_cfg), extra_eos_ids=gen_eos)
  if config is not None:
    check_vocab(config, tok)
  return tok
