"""The tokens of the LaTeX answer grammar (`jetrl.data.latex_grammar`): its lexicon and the
tokenizer that cuts a normalised answer into numbers, single letters, commands and operators.

Anything else (a quote, `<`, a character outside the lexicon, a number longer than MAX_DIGITS,
an answer longer than MAX_CHARS) is `Unsupported`. Standard library only: the sympy worker
loads it, with the grammar, by file path (see `jetrl.data.sympy_worker.load_grammar`).
"""

import re

MAX_CHARS = 400  # longer answers are not parsed
MAX_DIGITS = 200  # digits in one number literal

FUNCTIONS = {
  "sin": "sin",
  "cos": "cos",
  "tan": "tan",
  "cot": "cot",
  "sec": "sec",
  "csc": "csc",
  "arcsin": "asin",
  "arccos": "acos",
  "arctan": "atan",
  "sinh": "sinh",
  "cosh": "cosh",
  "tanh": "tanh",
  "log": "log",
  "ln": "log",
  "exp": "exp",
}
# `\\sin^{-1}` and kin: the inverse function (sympy's name), never the reciprocal.
INVERSES = {
  "sin": "asin",
  "cos": "acos",
  "tan": "atan",
  "cot": "acot",
  "sec": "asec",
  "csc": "acsc",
  "sinh": "asinh",
  "cosh": "acosh",
  "tanh": "atanh",
}
PLAIN_NAMES = ("sin", "cos", "tan", "log", "ln", "exp", "sqrt", "pi")  # without a backslash
GREEK = frozenset(
  """
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi
rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Phi Psi
Omega""".split()
)
TIMES = frozenset(("cdot", "times", "ast"))
IGNORED = frozenset(
  (
    "displaystyle",
    "textstyle",
    "left",
    "right",
    "mathrm",
    "mathbf",
    "mathit",
    "rm",
    "quad",
    "qquad",
    ",",
    ";",
    ":",
    "!",
    " ",
    "%",
  )
)
FRACS = frozenset(("frac", "dfrac", "tfrac"))

_TOKEN = re.compile(
  r"(?P<space>\s+)"
  r"|(?P<num>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
  r"|(?P<letter>[A-Za-z])"
  r"|\\(?P<cmd>[A-Za-z]+|[,;:! %{}|])"
  r"|(?P<op>[-+*/^_()\[\]{}!,=%])"
)


class Unsupported(ValueError):
  """The answer is outside the grammar (or its value would be too large to compute)."""


def tokenize(s: str) -> list:
  """[(kind, text)] with kind in num, letter, cmd, op; raises Unsupported on anything else."""
  if not isinstance(s, str):
    raise Unsupported("not a string")
  if len(s) > MAX_CHARS:
    raise Unsupported("too long")
  out = []
  pos = 0
  while pos < len(s):
    m = _TOKEN.match(s, pos)
    if m is None:
      raise Unsupported(f"character {s[pos]!r}")
    pos = m.end()
    kind = m.lastgroup
    text = m.group(kind)
    if kind == "space" or (kind == "cmd" and text in IGNORED) or (kind == "op" and text == "%"):
      continue
    if kind == "num" and len(text.replace(".", "")) > MAX_DIGITS:
      raise Unsupported("number too long")
    out.append((kind, text))
  return out
