"""Finding the final answer in a completion: its answer slots (`\\boxed{...}`, the `####` line)
and the number they hold.

A slot is read by the number grammar of `jetrl.data.number_answer` (`read_number`): exactly one
number in an accepted spelling, or no answer. Pure string functions; none of them raises on any
str input (non-str input gives None). Digits are ASCII only: a number written with other
Unicode digits is not a number here.
"""

from __future__ import annotations

import re

from jetrl.data.math_normalize import match_brace
from jetrl.data.number_answer import (
  MAX_NUMBER_CHARS,
  canonical_number,
  read_number,
)
from jetrl.data.number_answer import last_number as _last_number_in_text

__all__ = [
  "MAX_NUMBER_CHARS",
  "DEFAULT_GSM8K_ORDER",
  "GSM8K_EXTRACTORS",
  "boxed_number",
  "canonical_number",
  "extract_boxed",
  "gsm8k_answer",
  "has_box",
  "hash_number",
  "hash_slot",
  "last_number",
]

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_HASH = re.compile(r"####[ \t]*")


def _last_match(pattern: re.Pattern, text) -> re.Match | None:
  """The last match of `pattern` in `text`, or None (also when `text` is not a string)."""
  last = None
  if isinstance(text, str):
    for last in pattern.finditer(text):
      pass
  return last


def has_box(text: str) -> bool:
  """Whether `text` holds a `\\boxed` or `\\fbox` command (balanced or not)."""
  return _last_match(_BOX, text) is not None


def extract_boxed(text: str) -> str | None:
  """Contents of the last `\\boxed{...}` or `\\fbox{...}` (braces balanced), else None.

  `\\boxed 5` (a space and no braces) gives the next token. Escaped braces `\\{`, `\\}` do not
  count towards the balance. An unbalanced last box (a cut-off completion) gives None.
  """
  last = _last_match(_BOX, text)
  if last is None:
    return None
  i = last.end()
  n = len(text)
  j = i
  while j < n and text[j] in " \t":
    j += 1
  if j >= n:
    return None
  if text[j] != "{":
    if j == i:  # `\boxedx` is some other command
      return None
    k = j
    while k < n and not text[k].isspace() and text[k] not in "$}":
      k += 1
    return text[j:k] or None
  k = match_brace(text, j)
  return text[j + 1 : k] if k >= 0 else None


def last_number(text: str) -> str | None:
  """The last number in `text`, canonical, or None (`number_answer.last_number`)."""
  return _last_number_in_text(text)


def hash_slot(text: str) -> str | None:
  """The rest of the line after the last `####` (GSM8K's answer marker), or None without one."""
  last = _last_match(_HASH, text)
  if last is None:
    return None
  end = text.find("\n", last.end())
  return text[last.end() :] if end < 0 else text[last.end() : end]


def hash_number(text: str) -> str | None:
  """The number that the `####` line holds, canonical, or None (`#### 18 - 2`, `#### 12 or
  thirteen` and `#### 12 dollars` hold none)."""
  return read_number(hash_slot(text))


def boxed_number(text: str) -> str | None:
  """The number that the last `\\boxed{}` holds, canonical, or None (`\\boxed{1, 8}`,
  `\\boxed{3+15=18}`, `\\boxed{5!}` and `\\boxed{18 \\text{ apples}}` hold none)."""
  return read_number(extract_boxed(text))


GSM8K_EXTRACTORS = {"hash": hash_number, "boxed": boxed_number, "last": last_number}
_SLOTS = {"hash": hash_slot, "boxed": extract_boxed}
DEFAULT_GSM8K_ORDER = ("hash", "boxed", "last")


def gsm8k_answer(text: str, order=DEFAULT_GSM8K_ORDER) -> str | None:
  """The final number of a GSM8K-style completion: the first answer slot of `order` that the
  completion has decides ("hash": the `####` line, "boxed": the last balanced box, "last": the
  last number of the text). A slot that is there but holds no number is no answer: neither a
  later slot nor the last number is read instead (`\\boxed{12}` then `#### 12 or 13` is none).
  """
  if not isinstance(text, str):
    return None
  for name in order:
    if name == "last":
      return last_number(text)
    slot = _SLOTS[name](text)
    if slot is not None:
      return read_number(slot)
  return None
