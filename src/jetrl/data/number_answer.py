"""The grammar of a number answer: what an answer slot of GSM8K and `chat_arithmetic` may hold.

An answer slot (the contents of a `\\boxed{}`, the rest of a `####` line) is read by
`read_number`: it holds exactly one number in an accepted spelling, or it has no answer.
There is no search for digits inside it: words, operators, functions, a second numeral or a
non-ASCII digit anywhere in the slot make it no answer, so `\\boxed{5!}`, `\\boxed{\\sqrt{144}}`,
`#### 12 or thirteen` and `#### 1२` give None. The accepted spellings (docs/tasks.md has the
table):

  - a sign: `-`, `+` or the Unicode minus U+2212, at most one, spacing after it allowed;
  - a currency mark `\\$` or `$`, before or after the sign;
  - ASCII digits, either plain (leading zeros allowed: `012` is 12) or in groups of three
    after a first group of 1 to 3 digits not starting with 0, all joined by the same one
    separator: `,`, `\\,`, `{,}` or `,\\!` (`1,080`, `1\\,000\\,000`; `1,2345`, `0,500`, `1, 080`
    are not numbers);
  - a decimal part `.5` (`.5` alone is 0.5; no exponent: `1e5` is not a number);
  - around it: spaces and spacing commands (`\\,`, `\\!`, `~`, `\\displaystyle` before it), one
    `\\%` or `%` after the number, one trailing `.`, and wrappers holding the whole slot:
    `\\text{}`, `\\textbf{}`, `\\textrm{}`, `\\mathrm{}`, `\\mathbf{}`, `\\mbox{}`, `\\boxed{}`,
    a brace group `{}`, `$...$`, `$$...$$`, `\\(...\\)` and Markdown bold `**...**`.

The value comes back canonical (`canonical_digits`): no `+`, no separators, no leading zeros
of the integer part, no trailing zeros of the fraction, `-0` as `0`, `.5` as `0.5`. Numbers
of more than MAX_NUMBER_CHARS digits are no answer.

`last_number` is the fallback of a completion that marks no answer slot: its last number in
the text (the same spellings, a sign only where it cannot be a hyphen between two terms), and
none when a non-ASCII digit (any Unicode digit) touches or follows it.

Pure functions; none of them raises on any input (a non-str gives None), and every regular
expression here runs in time linear in its input.
"""

from __future__ import annotations

import re

from jetrl.data.math_normalize import match_brace

MAX_NUMBER_CHARS = 100  # longer "numbers" are not answers (and would be costly to compare)
MAX_SLOT_CHARS = 400  # a longer slot is no answer
UNICODE_MINUS = "\u2212"

_GAP = r"(?:[ \t]|\\[,;:! ])*"  # spacing between a sign or a currency mark and the digits
_SIGN = r"[-+\u2212]"
_CURRENCY = r"(?:\\\$|\$)"
# A thousands-grouped integer (one separator kind per number), or plain digits.
_INTEGER = (
  r"(?:[1-9][0-9]{0,2}(?P<sep>,\\!|\{,\}|\\,|,)[0-9]{3}(?:(?P=sep)[0-9]{3})*(?![0-9])"
  r"|[0-9]+)"
)
_DIGITS = rf"(?P<digits>{_INTEGER}(?:\.[0-9]+)?|\.[0-9]+)"
_CORE = re.compile(
  rf"(?:(?P<sign1>{_SIGN}){_GAP})?(?:{_CURRENCY}{_GAP})?(?:(?P<sign2>{_SIGN}){_GAP})?{_DIGITS}"
)
# In running text: a sign counts only where it cannot be a hyphen between two terms.
_TEXT_NUMBER = re.compile(
  rf"(?:(?<![0-9A-Za-z)\]}}])(?P<sign1>{_SIGN})[ ]?)?(?:{_CURRENCY}[ ]?)?{_DIGITS}"
)
_SEPARATORS = re.compile(r",\\!|\{,\}|\\,|,")
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|boxed)[ ]*\{")
_PERCENT = re.compile(r"(?:\\%|%)\Z")
# Spacing commands and `\\displaystyle` at either end of a slot (`\\boxed{\\displaystyle 12\\,}`).
_OUTER_SPACING = re.compile(
  r"((?:\\displaystyle(?![A-Za-z])|\\[,;:! ]|~|\s)*)(.*?)((?:\\[,;:! ]|~|\s)*)", re.S
)


def canonical_digits(sign: str | None, digits: str) -> str | None:
  """The canonical form of a validated digit string with its sign, or None when too long."""
  digits = _SEPARATORS.sub("", digits)
  if len(digits) > MAX_NUMBER_CHARS:
    return None
  whole, _, frac = digits.partition(".")
  whole = whole.lstrip("0") or "0"
  frac = frac.rstrip("0")
  out = whole + ("." + frac if frac else "")
  return "-" + out if sign in ("-", UNICODE_MINUS) and out != "0" else out


def _read_core(s: str) -> str | None:
  """The canonical value when `s` is exactly one signed, maybe currency-marked number."""
  m = _CORE.fullmatch(s)
  if m is None or (m.group("sign1") and m.group("sign2")):
    return None
  return canonical_digits(m.group("sign1") or m.group("sign2"), m.group("digits"))


def canonical_number(text) -> str | None:
  """A number in canonical form, or None unless `text` is exactly one number (outer spaces,
  a sign, `$` / `\\$` and separators allowed; no wrappers, no trailing `.`: `5.` gives None)."""
  if not isinstance(text, str) or len(text) > MAX_SLOT_CHARS:
    return None
  return _read_core(text.strip(" \t\n\r"))


def _unwrap(s: str) -> str | None:
  """The inside of a wrapper that holds the whole of `s`, or None if there is none."""
  for mark in ("$$", "**"):
    if len(s) >= 2 * len(mark) and s.startswith(mark) and s.endswith(mark):
      return s[len(mark) : -len(mark)]
  if len(s) >= 2 and s[0] == "$" and s[-1] == "$" and "$" not in s[1:-1].replace("\\$", ""):
    return s[1:-1]
  if s.startswith("\\(") and s.endswith("\\)"):
    return s[2:-2]
  m = _OUTER_SPACING.fullmatch(s)
  if m and (m.group(1) or m.group(3)):
    return m.group(2)
  m = _WRAPPER.match(s)
  start = m.end() - 1 if m else (0 if s.startswith("{") else -1)
  if start >= 0 and match_brace(s, start) == len(s) - 1:
    return s[start + 1 : -1]
  return None


def read_number(slot) -> str | None:
  """The canonical number an answer slot holds, or None (see the module docstring)."""
  if not isinstance(slot, str) or len(slot) > MAX_SLOT_CHARS:
    return None
  s = slot.strip()
  period = percent = False
  for _ in range(12):  # each step shortens s; wrappers nest a few deep at most
    value = _read_core(s)
    if value is not None:
      return value
    inner = _unwrap(s)
    if inner is not None:
      s = inner.strip()
    elif s.endswith(".") and not period:
      period, s = True, s[:-1].rstrip(" \t")
    elif _PERCENT.search(s) and not percent:
      percent, s = True, _PERCENT.sub("", s).rstrip(" \t")
    else:
      return None
  return None


def last_number(text) -> str | None:
  """The last number of running text, canonical, or None (see the module docstring)."""
  if not isinstance(text, str):
    return None
  last = None
  for last in _TEXT_NUMBER.finditer(text):
    pass
  if last is None:
    return None
  if (last.start() > 0 and text[last.start() - 1].isdigit()) or any(
    c.isdigit() for c in text[last.end() :]
  ):
    return None  # a digit of another script touches or follows it
  return canonical_digits(last.group("sign1"), last.group("digits"))
