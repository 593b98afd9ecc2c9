"""The LaTeX answer grammar: values against hand-computed numbers, exact types (no floats, no
string parsing), LaTeX's one-character scripts, and what it refuses (quickly)."""

import cmath
import math
import re
import time

import pytest
import sympy

from jetrl.data import get_task, normalize_latex
from jetrl.data.latex_grammar import MAX_BITS, Unsupported, parse_latex, tokenize
from jetrl.data.math_normalize import split_name
from shared_data import MATH500_FILE, needs_shared

# (answer, {symbol: value}, the value worked out by hand with Python floats)
VALUES = [
  ("\\frac{1}{2}", {}, 0.5),
  ("0.25", {}, 0.25),
  ("2\\sqrt{5}", {}, 2 * math.sqrt(5)),
  ("\\sqrt[3]{8}", {}, 2.0),
  ("\\binom{5}{2}", {}, 10.0),
  ("5!", {}, 120.0),
  ("7!!", {}, 7 * 5 * 3 * 1.0),
  ("(3!)!", {}, 720.0),
  ("2^{10}", {}, 1024.0),
  ("2^{-1}", {}, 0.5),
  ("2^10", {}, 2.0 * 0),  # LaTeX: 2^1 0
  ("x^23", {"x": 2.0}, 2.0**2 * 3),  # LaTeX: x^2 3
  ("\\frac12", {}, 0.5),  # \frac{1}{2}
  ("-x^2", {"x": 3.0}, -9.0),
  ("-2^2", {}, -4.0),
  ("1/2/2", {}, 0.25),
  ("3\\cdot4\\div6", {}, 2.0),
  ("2\\times3+4", {}, 10.0),
  ("\\sin\\frac{\\pi}{6}", {}, 0.5),
  ("\\sin^2x+\\cos^2x", {"x": 0.3}, 1.0),
  ("\\sin 2x", {"x": 0.4}, math.sin(0.8)),
  ("\\sin(x)^2", {"x": 0.4}, math.sin(0.4) ** 2),
  ("\\tan\\frac{\\pi}{4}", {}, 1.0),
  ("\\arctan1", {}, math.pi / 4),
  ("\\log_28", {}, 3.0),  # \log_2 8
  ("\\log_{10}1000", {}, 3.0),
  ("\\ln e^2", {}, 2.0),
  ("e^{i\\pi}", {}, -1.0),
  ("6+9i", {}, 6 + 9j),
  ("\\frac{\\sqrt{3}}{3}", {}, math.sqrt(3) / 3),
  ("2\\pi r", {"r": 1.5}, 3 * math.pi),
  ("\\frac{-b+\\sqrt{b^2-4ac}}{2a}", {"a": 1.0, "b": -3.0, "c": 2.0}, 2.0),
  ("x_1+x_{12}", {"x_1": 1.0, "x_12": 10.0}, 11.0),
  ("\\alpha\\beta", {"alpha": 2.0, "beta": 3.5}, 7.0),
  ("10\\%", {}, 10.0),
  ("\\left(1+\\frac{1}{3}\\right)^2", {}, (4 / 3) ** 2),
  ("\\sqrt{2}^{2}", {}, 2.0),
  ("3\\sqrt{2}\\sqrt{8}", {}, 12.0),
  ("\\exp(1)-e", {}, 0.0),
  ("\\mathrm{4}\\displaystyle\\,2", {}, 8.0),
]


@pytest.mark.parametrize("latex, at, expected", VALUES)
def test_values_match_hand_computed_numbers(latex, at, expected):
  value = parse_latex(latex)
  subs = {sympy.Symbol(k): v for k, v in at.items()}
  got = complex(sympy.N(value.subs(subs), 30))
  assert cmath.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-12), (latex, value, got)


def test_numbers_are_exact_and_never_floats():
  assert parse_latex("0.1") == sympy.Rational(1, 10)
  assert parse_latex("123456789012345678901234567890") == 123456789012345678901234567890
  assert parse_latex(".5") == sympy.Rational(1, 2)
  for s in ("0.1+0.2", "3.14159\\cdot2", "\\frac{0.5}{0.25}"):
    assert not parse_latex(s).atoms(sympy.Float), s
  assert parse_latex("0.1+0.2") == sympy.Rational(3, 10)  # exact, unlike 0.1 + 0.2 in floats


def test_tuples_and_symbols():
  assert parse_latex("(1,2)") == sympy.Tuple(1, 2)
  assert parse_latex("1,-2") == sympy.Tuple(1, -2)
  assert parse_latex("[3]") == 3
  assert parse_latex("xy") == sympy.Symbol("x") * sympy.Symbol("y")
  assert parse_latex("E") == sympy.Symbol("E")  # an upper-case letter is a letter
  assert parse_latex("e") == sympy.E and parse_latex("i") == sympy.I
  assert parse_latex("-\\infty") == -sympy.oo


def test_size_guards_refuse_before_computing():
  assert parse_latex("2^{2^{16}}") == 2**65536  # 65,536 bits: computed
  start = time.monotonic()
  for huge in (
    "2^{2^{17}}",
    "10^{10^{10}}",
    "9^{9^{9^{9}}}",
    "(10^{10})!",
    "2001!",
    "\\binom{10^{10}}{5000000}",
    "\\binom{2^{200}}{2^{10}}",
    "(\\sqrt{2})^{20001}",
    "2^{\\frac{10^{9}}{3}}",
    "\\sqrt[\\frac{1}{10^{9}}]{2}",
  ):
    with pytest.raises(Unsupported, match="too large"):
      parse_latex(huge)
  assert time.monotonic() - start < 5
  assert 2**17 > MAX_BITS


@pytest.mark.parametrize(
  "text",
  [
    "x.y",
    "a'",
    "x<1",
    "x=1",
    "\\foo",
    "\\input{x}",
    "\\{1\\}",
    "[1,2)",
    "(1,2]",
    "[1,2]",
    "(" * 60 + "1" + ")" * 60,
    "-" * 100 + "1",
    "1" * 201,
    "x" * 401,
    "\\sqrt",
    "\\frac{1}",
    "1\\\\2",
    "α",
    "５",
    "ｅｘｅｃ",
    "__import__",
    "2(1,2)",
    "(1,2)+1",
    "\\sin(1,2)",
    "",
    "x^",
    "\\pi!",
    "{1",
    "1}",
    "(1",
    '"1"',
    "`1`",
    "$1$",
    "1;2",
    "\\text{a}\\{",
  ],
)
def test_outside_the_grammar_is_unsupported(text):
  with pytest.raises(Unsupported):
    parse_latex(text)


def test_tokens():
  assert tokenize("\\frac{12}{x_1}\\,\\%") == [
    ("cmd", "frac"),
    ("op", "{"),
    ("num", "12"),
    ("op", "}"),
    ("op", "{"),
    ("letter", "x"),
    ("op", "_"),
    ("num", "1"),
    ("op", "}"),
  ]


def _split_top(s, seps):
  """`s` cut at the separators `seps` outside any (), [], {}, \\{\\} nesting, separators kept."""
  parts, depth, start, i = [], 0, 0, 0
  while i < len(s):
    if s.startswith(("\\{", "\\}"), i):
      depth += 1 if s[i + 1] == "{" else -1
      i += 2
      continue
    if s[i] in "([{":
      depth += 1
    elif s[i] in ")]}":
      depth -= 1
    elif depth == 0:
      sep = next((x for x in seps if s.startswith(x, i)), None)
      if sep:
        parts += [s[start:i], sep]
        i = start = i + len(sep)
        continue
    i += 1
  return parts + [s[start:]]


def _in_parens(text, seps):
  """Every item of `text` between `seps` put in parentheses: the same value, a new string."""
  return "".join(p if p in seps else f"({p})" for p in _split_top(text, seps))


# Gold answers the grammar does not take (base-n numerals, unions of intervals, equations),
# multiple-choice letters (`(B)` is how a choice is written, normalised to `B`) and words
# (`\text{east}`, compared as text): only their spelling is changed, so they stay equal as
# normalised strings.
OUTSIDE_GRAMMAR = re.compile(r"[0-9]_\{?[0-9]|\\cup|=|^[A-Z]$|\\text\{")


def _equivalent_form(gold):
  """A completion whose boxed answer equals `gold` in value but not as a normalised string
  (each number, item or matrix cell in parentheses), spelled the way models write: `\\dfrac`,
  `\\left(`/`\\right)`, spaces, `$` around it. (form, whether the grammar must equate it)."""
  name, n = split_name(normalize_latex(gold))  # `x\\in` is kept, the value after it rewritten
  grammar = not OUTSIDE_GRAMMAR.search(n)
  if grammar:
    matrix = re.fullmatch(r"(\\begin\{pmatrix\})(.*)(\\end\{pmatrix\})", n)
    opener = next((o for o in ("\\{", "(", "[") if n.startswith(o)), "")
    closer = next((c for c in ("\\}", ")", "]") if n.endswith(c)), "")
    inner = n[len(opener) : len(n) - len(closer)] if opener and closer else n
    if matrix:
      n = matrix[1] + _in_parens(matrix[2], ("\\\\", "&")) + matrix[3]
    elif opener and closer and (len(_split_top(inner, [","])) > 1 or opener != "("):
      n = opener + _in_parens(inner, [","]) + closer  # a tuple, interval or set
    else:
      n = _in_parens(n, [","])  # a number, expression or unbracketed list
  spelled = name + n.replace("\\frac", "\\dfrac").replace("(", "\\left( ").replace(")", " \\right)")
  return f"so the answer is $ \\boxed{{ {spelled.replace(',', ' , ')} }} $.", grammar


@needs_shared
def test_math500_gold_answers_score_one_against_equivalent_forms():
  """Each gold answer against a form of it that only the grammar (sympy, in the worker) can
  equate; with the worker off, exactly those score 0."""
  task = get_task(
    "math500",
    path=str(MATH500_FILE),
    split={"train": "test", "test": "test"},
    batch_timeout=120.0,
  )
  answers = [p.answer for p in task.batch("test", 0, 500)]
  forms, through_grammar = zip(*(_equivalent_form(a) for a in answers))
  assert task.reward(None, list(forms), answers) == [1.0] * 500
  strings_only = get_task(
    "math500", path=str(MATH500_FILE), split={"train": "test", "test": "test"}, symbolic=False
  )
  without_grammar = strings_only.reward(None, list(forms), answers)
  assert without_grammar == [0.0 if g else 1.0 for g in through_grammar]
  # 482 of the 500 go through the grammar; the other 18 are 6 base-n numerals, 3 unions of
  # intervals, 3 multiple-choice letters, 5 words and 1 equation.
  assert sum(through_grammar) == 482
  parsed = 0
  for a in answers:
    try:
      parse_latex(split_name(normalize_latex(a))[1])  # `x=5` is compared as its value
      parsed += 1
    except Unsupported:
      pass
  # The rest are intervals, matrices, base-n numerals and unions, which are compared
  # structurally before the grammar is asked (jetrl.data.math_equivalence).
  assert parsed >= 470, parsed
