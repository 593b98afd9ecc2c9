"""Normalising LaTeX final answers (MATH style) so that equal answers compare equal as strings.

`normalize_latex` removes what does not change an answer's value: spacing commands and
spaces, `\\left`/`\\right`/`\\big`, `\\displaystyle`, dollar signs, percent signs, degree marks
(`^\\circ`, `^{\\circ}`, `°`), `\\text{}`/`\\mbox{}` wrappers around math, unit words at the
end of the answer (in `\\text{}` after a value, or bare words of two letters or more after a
number, each with a `^2` / `^3` of their own; radians are not a unit word, since degree marks
are dropped), a trailing period, thousands separators in a plain number, and
`\\dfrac`/`\\tfrac` spelling. Unit words anywhere else stay text (`5 \\text{ m } 2` is not
`52`). Words stay text, written `\\text{words}`, compared as text and never as a product of
letters. A leading `x =` is kept: `split_name` finds it, and `math_equal` drops it only where
the other answer names the same variable or is a bare value (`y = 5` is not `x = 5`). It also writes shorthand
arguments out (`\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`), one-character
exponents and subscripts without braces (`x^{2}` -> `x^2`), and `.5` as `0.5`.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 1000  # longer answers are compared verbatim only

UNIT_WORDS = frozenset(
  """
unit units sq square squared cubic cu cm centimeter centimeters centimetre centimetres mm
millimeter millimeters m meter meters metre metres km kilometer kilometers in inch inches ft
foot feet yd yard yards mi mile miles degree degrees deg cent cents dollar
dollars s sec second seconds min minute minutes h hr hrs hour hours day days week weeks month
months year years mph kph pound pounds lb lbs ounce ounces oz gallon gallons liter liters litre
litres ml g gram grams kg kilogram kilograms ton tons mg per each
""".split()
)

_TEXT_CMDS = (
  "text",
  "textbf",
  "textit",
  "textrm",
  "textnormal",
  "mbox",
  "mathrm",
  "mathbf",
  "mathit",
  "boldsymbol",
  "operatorname",
)
_SPACING = re.compile(
  r"(\\\\)|\\[,;:! ]|\\(?:qquad|quad|displaystyle|textstyle|scriptstyle)(?![A-Za-z])|~"
)
_DELIMS_DOT = re.compile(r"\\(?:left|right)\s*\.")
_DELIMS = re.compile(r"\\(?:left|right|[Bb]igg?[lr]?)(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_FRAC_SPELLING = re.compile(r"\\[dt]frac(?![A-Za-z])")
_CMD_THEN_LETTER = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_ONE_CHAR_SCRIPT = re.compile(r"([\^_])\{([A-Za-z0-9])\}")
_LEADING_POINT = re.compile(r"(?<![0-9])\.([0-9])")
_THOUSANDS = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
_VAR_PREFIX = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_[A-Za-z0-9]+)?(?:=|\\in(?![A-Za-z]))")
_CHOICE = re.compile(r"\(([A-Z])\)")
_WORD = re.compile(r"[A-Za-z]{2}")
_UNIT_TAIL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz. ")
_SQUARED_END = re.compile(r"\^(?:\{[23]\}|[23])\Z")
_UNIT_POWER = re.compile(r"[ ]*\^[ ]*(?:\{[ ]*[23][ ]*\}|[23](?![0-9]))")
_RENAMES = (
  (re.compile(r"\\(?:leqslant|leq)(?![A-Za-z])"), r"\\le"),
  (re.compile(r"\\(?:geqslant|geq)(?![A-Za-z])"), r"\\ge"),
  (re.compile(r"\\neq(?![A-Za-z])"), r"\\ne"),
  (re.compile(r"\\varnothing(?![A-Za-z])"), r"\\emptyset"),
  (re.compile(r"\\lbrace(?![A-Za-z])"), r"\\{"),
  (re.compile(r"\\rbrace(?![A-Za-z])"), r"\\}"),
  (re.compile(r"\\[lr]?vert(?![A-Za-z])"), "|"),
  (re.compile(r"\\(?:dots|ldots|cdots)(?![A-Za-z])"), r"\\dots"),
)


def match_brace(s: str, i: int) -> int:
  """Index of the `}` closing the `{` at s[i] (escaped braces skipped), or -1."""
  depth = 0
  k = i
  n = len(s)
  while k < n:
    c = s[k]
    if c == "\\":
      k += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return k
    k += 1
  return -1


def _is_units(words: str, min_len: int = 1) -> bool:
  parts = [w.strip(".").lower() for w in re.split(r"[\s~]+", words.strip())]
  parts = [w for w in parts if w]
  return bool(parts) and all(w in UNIT_WORDS and len(w) >= min_len for w in parts)


def _strip_trailing_units(s: str) -> str:
  """`5 cm^2` -> `5`: drops unit words of two letters or more (and a ^2 / ^3) that end the
  answer after a number or a closing brace (`2 s^2` keeps its variable s and its power).

  One pass from the end, linear in the length (a backtracking regex here once took seconds
  on a number followed by a thousand spaces).
  """
  end = len(s.rstrip(" "))
  m = _SQUARED_END.search(s, 0, end)
  core = end if m is None else m.start()
  k = core
  while k > 0 and s[k - 1] in _UNIT_TAIL_CHARS:
    k -= 1
  words = s[k:core]
  lead = len(words) - len(words.lstrip(" "))
  if k == 0 or s[k - 1] not in "0123456789}" or lead == 0 or not _is_units(words[lead:], 2):
    return s
  return s[:k]


_TEXT_WRAPPER = re.compile(r"\\(?:%s)(?![A-Za-z])\s*\{" % "|".join(_TEXT_CMDS))


def _only_units(rest: str) -> bool:
  """Whether `rest` is nothing but spaces, a period and `\\text{unit words}` (each maybe with
  its own ^2 / ^3): what may follow units that are dropped."""
  r = rest.strip(" .")
  while r:
    m = _TEXT_WRAPPER.match(r)
    close = match_brace(r, m.end() - 1) if m else -1
    if close < 0 or not _is_units(r[m.end() : close]):
      return False
    r = r[close + 1 :]
    power = _UNIT_POWER.match(r)
    r = r[power.end() if power else 0 :].strip(" .")
  return True


def _unwrap_text(s: str) -> str:
  """Replaces `\\text{X}` and friends by X, or by nothing when X is unit words after content
  that end the answer; unit words anywhere else stay `\\text{X}`, so they never join the
  values around them."""
  pattern = _TEXT_WRAPPER
  out = []
  pos = 0
  while True:
    m = pattern.search(s, pos)
    if m is None:
      break
    close = match_brace(s, m.end() - 1)
    if close < 0:
      break
    inner = s[m.end() : close]
    before = "".join(out) + s[pos : m.start()]
    out.append(s[pos : m.start()])
    units = before.strip() and _is_units(inner)
    tail = _UNIT_POWER.match(s, close + 1) if units else None
    after = tail.end() if tail else close + 1
    if units and _only_units(s[after:]):
      pos = after  # drop the units, and a ^2 / ^3 of theirs
    elif units:
      out.append(" \\text{" + " ".join(inner.split()) + "} ")
      pos = close + 1
    else:
      inner = _strip_trailing_units(" ".join(inner.split()))
      if _WORD.search(inner):  # words stay text: `\text{seat}` is not s*e*a*t
        inner = "\\text{" + inner + "}"
      out.append(" " + inner + " " if inner.strip() else "")
      pos = close + 1
  out.append(s[pos:])
  return "".join(out)


def _fill_args(s: str, cmd: str, nargs: int) -> str:
  """Writes shorthand arguments out: `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`."""
  pattern = re.compile(r"\\%s(?![A-Za-z])" % cmd)
  out = []
  pos = 0
  for m in pattern.finditer(s):
    if m.start() < pos:
      continue
    out.append(s[pos : m.end()])
    k = m.end()
    if cmd == "sqrt" and k < len(s) and s[k] == "[":
      close = s.find("]", k)
      if close < 0:
        break
      out.append(s[k : close + 1])
      k = close + 1
    for _ in range(nargs):
      if k >= len(s):
        break
      if s[k] == "{":
        close = match_brace(s, k)
        if close < 0:
          break
        out.append(s[k : close + 1])
        k = close + 1
      elif s[k] == "\\":
        name = re.match(r"\\[A-Za-z]+|\\.", s[k:]).group()
        out.append("{" + name + "}")
        k += len(name)
      else:
        out.append("{" + s[k] + "}")
        k += 1
    pos = k
  out.append(s[pos:])
  return "".join(out)


def normalize_latex(answer: str) -> str:
  """A canonical string form of a LaTeX answer (see the module docstring)."""
  if not isinstance(answer, str):
    return ""
  s = answer.strip()
  if len(s) > MAX_ANSWER_CHARS:
    return s
  s = s.replace("\n", " ").replace("\r", " ").replace("\t", " ")
  s = _SPACING.sub(lambda m: m.group(1) or " ", s)  # keeps `\\` (a line break)
  s = _FRAC_SPELLING.sub(r"\\frac", s)
  s = _DELIMS_DOT.sub("", s)
  s = _DELIMS.sub("", s)
  s = _DEGREES.sub("", s)
  s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
  s = s.replace("{,}", ",")
  for pattern, new in _RENAMES:
    s = pattern.sub(new, s)
  s = _unwrap_text(s)
  s = _strip_trailing_units(s)
  s = s.strip().rstrip(".").strip()
  # Spaces carry no meaning, except between a command and a letter (`\pi r`).
  s = _CMD_THEN_LETTER.sub("\\1\0", s)
  s = re.sub(r"\s+", "", s).replace("\0", " ")
  s = _fill_args(s, "frac", 2)
  s = _fill_args(s, "sqrt", 1)
  s = _ONE_CHAR_SCRIPT.sub(r"\1\2", s)
  s = _LEADING_POINT.sub(r"0.\1", s)
  if _THOUSANDS.fullmatch(s):
    s = s.replace(",", "")
  m = _CHOICE.fullmatch(s)
  if m:
    s = m.group(1)
  return s.rstrip(".")


def split_name(s: str) -> tuple[str, str]:
  """(`x=`, rest) when the normalised answer `s` names one variable (`x=5`, `\\theta=\\pi`,
  `x\\in[0,1]`), else ("", s)."""
  m = _VAR_PREFIX.match(s)
  if m and s.count("=") <= 1 and m.end() < len(s) and "," not in s[: m.end()]:
    return s[: m.end()], s[m.end() :]
  return "", s
