"""Finding the final answer in a completion: `\\boxed{...}` contents and final numbers.

Pure string functions; none of them raises on any str input (non-str input gives None).
Digits are ASCII only: a number written with other Unicode digits is not a number here.
"""

from __future__ import annotations

import re

from jetrl.data.math_normalize import match_brace

MAX_NUMBER_CHARS = 100  # longer "numbers" are not answers (and would be costly to compare)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_SIGNED = r"(?<![0-9A-Za-z)\]}])[-+]"  # a sign, unless it reads as a minus between two terms
NUMBER = re.compile(
  rf"(?:{_SIGNED}[ ]?)?(?:\\?\$[ ]?)?"  # optional sign, optional dollar sign
  r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+|(?=\.[0-9]))"  # integer part, maybe with thousands commas
  r"(?:\.[0-9]+)?"
)  # decimals
_HASH = re.compile(r"####[ \t]*")
_CANONICAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)")
_THOUSANDS = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|\.?[0-9]+(?:\.[0-9]+)?")
_SIGN_SPACE = re.compile(r"([-+])[ ]+")
# What may follow the number after `####` on its line: words and end punctuation, never
# another number or an operator (`#### 18 - 2` is not 18).
_AFTER_HASH = re.compile(r"[^\n0-9+\-*/^=\\×÷]*(?:\n|\Z)")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


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


def canonical_number(text: str) -> str | None:
  """A decimal number in canonical form, or None if `text` is not one.

  Drops `$`, `\\$`, outer spaces, a space after the sign, thousands commas and a leading `+`;
  strips leading zeros of the integer part and trailing zeros of the fraction (so `1,000.50` ->
  `1000.5`, `+7.0` -> `7`, `-0` -> `0`, `.5` -> `0.5`). A comma is a thousands separator only
  between groups of three digits (`1,080`; `1,0,8,0` and `10,80` are not numbers), and a
  space inside the digits separates two numbers (`1 8` is not 18). Numbers over
  MAX_NUMBER_CHARS characters give None.
  """
  if not isinstance(text, str) or len(text) > 4 * MAX_NUMBER_CHARS:
    return None
  s = _SIGN_SPACE.sub(r"\1", text.replace("\\$", "").replace("$", "").strip(), count=1)
  s = s.replace("$", "").strip()
  digits = s.lstrip("+-")
  if not _THOUSANDS.fullmatch(digits):
    return None
  s = s.replace(",", "")
  if s.startswith("+"):
    s = s[1:]
  if not _CANONICAL.fullmatch(s) or len(s) > MAX_NUMBER_CHARS:
    return None
  neg = s.startswith("-")
  s = s.lstrip("-")
  whole, _, frac = s.partition(".")
  whole = whole.lstrip("0") or "0"
  frac = frac.rstrip("0")
  out = whole + ("." + frac if frac else "")
  return "-" + out if neg and out != "0" else out


def last_number(text: str) -> str | None:
  """The last number in `text`, canonical, or None."""
  found = _last_match(NUMBER, text)
  return None if found is None else canonical_number(found.group())


def hash_number(text: str) -> str | None:
  """The number right after the last `####` (GSM8K's answer marker), canonical, or None."""
  last = _last_match(_HASH, text)
  if last is None:
    return None
  m = NUMBER.match(text, last.end())
  if m is None or not _AFTER_HASH.match(text, m.end()):
    return None
  return canonical_number(m.group())


def boxed_number(text: str) -> str | None:
  """The number in the last `\\boxed{}`, canonical, or None.

  The whole box when it is a number (after unwrapping `\\text{}` and dropping `\\%`), else the
  one number inside it (`\\boxed{18 \\text{ apples}}`). A box holding several numbers
  (`\\boxed{1, 8}`, `\\boxed{1 8}`, `\\boxed{3+15=18}`) gives None.
  """
  content = extract_boxed(text)
  if content is None:
    return None
  content = _TEXT_WRAPPER.sub(r"\1", content).replace("\\%", "").replace("%", "").strip()
  whole = canonical_number(content)
  if whole is not None:
    return whole
  found = NUMBER.findall(content)
  return canonical_number(found[0]) if len(found) == 1 else None


GSM8K_EXTRACTORS = {"hash": hash_number, "boxed": boxed_number, "last": last_number}
DEFAULT_GSM8K_ORDER = ("hash", "boxed", "last")


def gsm8k_answer(text: str, order=DEFAULT_GSM8K_ORDER) -> str | None:
  """The final number of a GSM8K-style completion, trying the extractors in `order`.

  A completion that marks its answer (`####`, a `\\boxed{}`) that cannot be read as one number
  has none: "last" is not tried after those extractors (`\\boxed{1, 8}` is not 8).
  """
  marked = False
  for name in order:
    if name == "last" and marked:
      return None
    found = GSM8K_EXTRACTORS[name](text)
    if found is not None:
      return found
    if name == "hash":
      marked = marked or _HASH.search(text) is not None
    elif name == "boxed":
      marked = marked or extract_boxed(text) is not None
  return None
