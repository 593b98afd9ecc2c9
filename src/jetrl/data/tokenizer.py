"""The tokenizer interface, and a character-level tokenizer for the synthetic tasks.

`Tokenizer` is the one interface the runner uses: the character tokenizer below, the
checkpoint tokenizer of `jetrl.models.load_tokenizer` (over the `tokenizers` library) and a
`transformers` tokenizer all satisfy it, with the same names for the same ids. `encode(text)`
gives the token ids of a sequence as the model expects it to start (bos first where the
tokenizer adds one); `encode(text, add_special_tokens=False)` gives the bare ids (a completion).
`stop_token_ids(tok)` gives every id that ends a generation. `chat_template` is the template's
source or None; `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`
renders it (a ValueError when there is none). `save_pretrained(directory)` writes the files
`transformers` reads the tokenizer back from.

The character tokenizer:

One token per character of a small fixed alphabet, plus three special tokens:
pad (id 0), bos (id 1), eos (id 2). The alphabet (ids 3, 4, ...) is, in order:

  newline, space, the digits 0-9, the symbols + - * / = < > : , . ( ), the letters a-z

which covers every character any synthetic task emits (a test checks this). A character outside
the alphabet is an error (`ValueError` naming it): there is no unknown token.

On disk the tokenizer is a `tokenizer.json` in the format of the `tokenizers` library (a
WordLevel model over single characters, a Split pre-tokenizer that isolates every character,
a Fuse decoder), so `tokenizers.Tokenizer.from_file` and `transformers` can read it too and
produce the same ids. The special tokens are spelled `<|pad|>`, `<|bos|>`, `<|eos|>`; `|` is
not in the alphabet, so no valid text can spell one by accident.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
ALPHABET = "\n 0123456789+-*/=<>:,.()abcdefghijklmnopqrstuvwxyz"
MAX_VOCAB = 128
FILENAME = "tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
  """What the runner needs of a tokenizer (`transformers` tokenizers have it too)."""

  @property
  def bos_token_id(self) -> Optional[int]: ...

  @property
  def eos_token_id(self) -> Optional[int]: ...

  @property
  def pad_token_id(self) -> Optional[int]: ...

  def __len__(self) -> int: ...

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

  @property
  def chat_template(self) -> Optional[str]:
    """The chat template's source (jinja), or None when the tokenizer has none."""
    ...

  def apply_chat_template(self, conversation, **kwargs) -> Any:
    """The chat template rendered for `conversation` ([{"role": ..., "content": ...}, ...]).
    Callers pass `tokenize=False` and `add_generation_prompt` and get the text; a tokenizer
    without a template raises ValueError."""
    ...

  def save_pretrained(self, directory: str) -> Any:
    """Writes the tokenizer's files (tokenizer.json, tokenizer_config.json, ...) to
    `directory`, where `transformers.AutoTokenizer.from_pretrained` reads them."""
    ...


def stop_token_ids(tok: Tokenizer) -> tuple[int, ...]:
  """Every id that ends a generation: `tok.eos_token_ids` where the tokenizer lists several
  (a checkpoint's generation_config.json may), else its eos token; () when it has none."""
  ids = getattr(tok, "eos_token_ids", None)  # a `transformers` tokenizer may answer one int
  if ids is None:
    ids = tok.eos_token_id
  if ids is None:
    return ()
  return (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids)


class CharTokenizer:
  """Character-level tokenizer: `encode(text) -> ids`, `decode(ids) -> text` (a `Tokenizer`)."""

  def __init__(self, alphabet: str = ALPHABET):
    if not isinstance(alphabet, str) or not alphabet:
      raise ValueError("alphabet must be a non-empty string of distinct characters")
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    if "|" in alphabet:
      raise ValueError("alphabet must not contain '|' (used to spell the special tokens)")
    if len(alphabet) + len(SPECIAL_TOKENS) > MAX_VOCAB:
      raise ValueError(
        f"vocabulary would have {len(alphabet) + len(SPECIAL_TOKENS)} tokens; at most "
        f"{MAX_VOCAB} are allowed"
      )
    self.alphabet = alphabet
    self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
    self._chars = list(SPECIAL_TOKENS) + list(alphabet)

  pad_token_id = 0
  bos_token_id = 1
  eos_token_id = 2
  eos_token_ids = (2,)
  chat_template = None  # plain text only: the synthetic tasks and tasks of your own

  @property
  def vocab_size(self) -> int:
    return len(self._chars)

  def __len__(self) -> int:
    return self.vocab_size

  def __eq__(self, other) -> bool:
    return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

  def __hash__(self) -> int:
    return hash(self.alphabet)

  def __repr__(self) -> str:
    return f"CharTokenizer(vocab_size={self.vocab_size})"

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Ids of the characters of `text`, with bos first when `add_special_tokens` (as the
    `tokenizers` library does with this tokenizer's tokenizer.json)."""
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    try:
      ids = [self._ids[c] for c in text]
    except KeyError:
      pos, bad = next((i, c) for i, c in enumerate(text) if c not in self._ids)
      raise ValueError(
        f"character {bad!r} (U+{ord(bad):04X}) at position {pos} is not in the tokenizer's "
        f"alphabet {self.alphabet!r}"
      ) from None
    if add_special_tokens:
      ids.insert(0, self.bos_token_id)
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids`: stops at the first eos, leaves out pad and bos (whether or not
    `skip_special_tokens`: the special tokens have no text)."""
    del skip_special_tokens
    out = []
    n = self.vocab_size
    for i in ids:
      i = int(i)
      if i == self.eos_token_id:
        break
      if i in (self.pad_token_id, self.bos_token_id):
        continue
      if not 0 <= i < n:
        raise ValueError(f"token id {i} is out of range [0, {n})")
      out.append(self._chars[i])
    return "".join(out)

  def can_encode(self, text: str) -> bool:
    return all(c in self._ids for c in text)

  def id_to_token(self, i: int) -> str:
    return self._chars[i]

  # ---- tokenizer.json ------------------------------------------------------------------

  def to_json(self) -> dict:
    """The `tokenizers` library's JSON form of this tokenizer."""
    vocab = {tok: i for i, tok in enumerate(self._chars)}
    added = [
      {
        "id": i,
        "content": tok,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
      }
      for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    return {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": added,
      "normalizer": None,
      "pre_tokenizer": {
        "type": "Split",
        "pattern": {"Regex": "[\\s\\S]"},
        "behavior": "Isolated",
        "invert": False,
      },
      # bos first when special tokens are added, as `encode` does.
      "post_processor": {
        "type": "TemplateProcessing",
        "single": [
          {"SpecialToken": {"id": BOS, "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
          {"SpecialToken": {"id": BOS, "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 0}},
          {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [1], "tokens": [BOS]}},
      },
      "decoder": {"type": "Fuse"},
      # The unk token is deliberately absent from the vocabulary: the `tokenizers` library
      # then refuses unknown characters instead of mapping them to some id.
      "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|unk|>"},
    }

  def to_tokenizers(self):
    """A `tokenizers.Tokenizer` with the same vocabulary."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(self.to_json()))

  def save(self, directory: str | os.PathLike) -> str:
    """Writes `directory/tokenizer.json`; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILENAME)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, ensure_ascii=False, indent=1)
    return path

  def save_pretrained(self, directory: str | os.PathLike) -> tuple[str, str]:
    """Writes tokenizer.json and a tokenizer_config.json naming the special tokens, so that
    `transformers.AutoTokenizer.from_pretrained(directory)` gives the same ids; returns the
    two paths."""
    path = self.save(directory)
    config = os.path.join(directory, "tokenizer_config.json")
    with open(config, "w", encoding="utf-8") as f:
      json.dump(
        {
          "tokenizer_class": "PreTrainedTokenizerFast",
          "bos_token": BOS,
          "eos_token": EOS,
          "pad_token": PAD,
        },
        f,
        indent=1,
      )
    return path, config

  def apply_chat_template(self, conversation, **kwargs):
    """The character tokenizer has no chat template: always a ValueError."""
    del conversation, kwargs
    raise ValueError(
      "the character tokenizer has no chat template: use the plain prompt format, or a "
      "checkpoint tokenizer with a chat template"
    )

  @classmethod
  def load(cls, directory: str | os.PathLike) -> "CharTokenizer":
    """Reads `directory/tokenizer.json` (or a path to the file itself) written by `save`."""
    path = os.fspath(directory)
    if os.path.isdir(path):
      path = os.path.join(path, FILENAME)
    if not os.path.isfile(path):
      raise ValueError(f"no {FILENAME} at {os.fspath(directory)!r}")
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    model = data.get("model") or {}
    if model.get("type") != "WordLevel":
      raise ValueError(
        f"{path}: not a character-level tokenizer (model type "
        f"{model.get('type')!r}, expected 'WordLevel')"
      )
    vocab = model.get("vocab") or {}
    by_id = sorted((i, tok) for tok, i in vocab.items())
    if [i for i, _ in by_id] != list(range(len(by_id))):
      raise ValueError(f"{path}: vocabulary ids are not 0..{len(by_id) - 1}")
    toks = [tok for _, tok in by_id]
    if tuple(toks[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
      raise ValueError(
        f"{path}: the first ids must be the special tokens {SPECIAL_TOKENS}, "
        f"found {toks[: len(SPECIAL_TOKENS)]}"
      )
    chars = toks[len(SPECIAL_TOKENS) :]
    if any(len(c) != 1 for c in chars):
      raise ValueError(f"{path}: every non-special token must be a single character")
    return cls("".join(chars))


def char_tokenizer(alphabet: str = ALPHABET) -> CharTokenizer:
  """The character tokenizer of the synthetic tasks."""
  return CharTokenizer(alphabet)
