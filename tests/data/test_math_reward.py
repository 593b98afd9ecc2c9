"""MATH answer extraction, LaTeX normalisation, equivalence and reward: every MATH-500
reference solution, rewritten real answers, and hand-written equivalent / different /
adversarial answers."""

import re
import time

import pytest

from jetrl.data import extract_boxed, math_equal, math_reward, normalize_latex
from jetrl.data.math_equivalence import DEFAULT_TIMEOUT, worker_stats
from jetrl.data.rewards import math_format_reward
from shared_data import MATH500_FILE, needs_shared, read_jsonl


@pytest.fixture(scope="module")
def math500():
  rows = read_jsonl(MATH500_FILE)
  assert len(rows) == 500
  return rows


def last_box_by_hand(solution: str) -> str:
  """Independent extraction: scan back to the last \\boxed{ / \\fbox{ and count braces."""
  start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
  assert start >= 0
  i = solution.index("{", start)
  depth = 0
  for j in range(i, len(solution)):
    depth += {"{": 1, "}": -1}.get(solution[j], 0)
    if depth == 0:
      return solution[i + 1 : j]
  raise AssertionError("unbalanced")


@needs_shared
def test_every_reference_solution_scores_one(math500):
  solutions = [r["solution"] for r in math500]
  answers = [r["answer"] for r in math500]
  assert [extract_boxed(s) for s in solutions] == [last_box_by_hand(s) for s in solutions]
  assert math_reward(None, solutions, answers) == [1.0] * 500
  assert math_reward(None, [f"so $\\boxed{{{a}}}$." for a in answers], answers) == [1.0] * 500
  # Exceptions: none. (Eight solutions box two answers; the last box is the answer in all.)


def rewrite(answer: str) -> str:
  """The same answer written differently: spacing, \\dfrac, \\left/\\right, $, a final period."""
  s = answer.replace("\\frac", "\\dfrac").replace(",", ", ").replace("+", " + ")
  s = re.sub(r"(?<!\\left)\((?!\s*\\right)", r"\\left( ", s)
  s = re.sub(r"(?<!\\right)\)", r" \\right)", s)
  return f"$ {s} $."


@needs_shared
def test_rewritten_real_answers_score_one(math500):
  answers = [r["answer"] for r in math500]
  rewritten = [f"\\boxed{{{rewrite(a)}}}" for a in answers]
  assert sum(rewrite(a) != a for a in answers) > 300
  scores = math_reward(None, rewritten, answers, symbolic=False)
  failed = [(a, r) for a, r, s in zip(answers, rewritten, scores) if s != 1.0]
  assert failed == []


def change_digit(answer: str) -> str | None:
  """The answer with its first digit changed (None if it has no digit)."""
  digits = [i for i, c in enumerate(answer) if c.isdigit()]
  if not digits:
    return None
  i = digits[0]
  return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]


# Real answers whose value a changed first digit does not change, with the reason.
UNCHANGED_BY_A_DIGIT = {}


@needs_shared
def test_changed_real_answers_score_zero(math500):
  pairs = [(change_digit(r["answer"]), r["answer"]) for r in math500]
  pairs = [(w, a) for w, a in pairs if w is not None]
  assert len(pairs) > 450
  scores = math_reward(
    None, [f"\\boxed{{{w}}}" for w, _ in pairs], [a for _, a in pairs], timeout=1.0
  )
  wrong = {a for (w, a), s in zip(pairs, scores) if s != 0.0}
  assert wrong <= set(UNCHANGED_BY_A_DIGIT), wrong


EQUAL = [
  ("\\frac{1}{2}", "0.5"),
  ("\\dfrac12", "\\frac{1}{2}"),
  ("1/2", "\\tfrac{1}{2}"),
  ("\\frac34", "0.75"),
  ("-\\frac{3}{4}", "-0.75"),
  ("2\\frac{1}{2}", "\\frac{5}{2}"),
  ("10,000", "10000"),
  ("10{,}000", "10000"),
  (".5", "0.5"),
  ("5.", "5"),
  ("5.0", "5"),
  ("\\$18.90", "18.9"),
  ("10\\%", "10"),
  ("76^\\circ", "76"),
  ("76^{\\circ}", "76"),
  ("76°", "76"),
  ("5 \\text{ cm}", "5"),
  ("5\\text{ cm}^2", "5"),
  ("12 \\mbox{ inches}", "12"),
  ("3 \\text{ units}", "3"),
  ("\\text{5 dollars}", "5"),
  ("\\text{(C)}", "C"),
  ("(C)", "\\text{(C)}"),
  ("\\text{Monday}", "Monday"),
  ("x = 5", "5"),
  ("k=-3", "-3"),
  ("x \\in [1, 2]", "[1,2]"),
  ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
  ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
  ("\\!1,\\!000", "1000"),
  ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
  ("2\\sqrt{5}", "\\sqrt{20}"),
  ("\\sqrt2", "\\sqrt{2}"),
  ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt3}"),
  ("x^2+2x+1", "(x+1)^2"),
  ("x^{2}", "x^2"),
  ("2\\pi r", "2r\\pi"),
  ("6+9i", "9i+6"),
  ("2^{10}", "1024"),
  ("\\sqrt[3]{8}", "2"),
  ("\\binom{5}{2}", "10"),
  ("5!", "120"),
  ("y = 2x+3", "2x + 3"),
  ("y=2x+3", "y=3+2x"),
  ("x+y=1", "1=y+x"),
  ("1,2", "2,1"),
  ("-2, 1", "1,-2"),
  ("1 \\pm \\sqrt{19}", "1-\\sqrt{19}, 1+\\sqrt{19}"),
  ("\\{1,2\\}", "\\{2,1\\}"),
  ("(2,12) \\cup (12,102)", "(2,12)\\cup(12,102)"),
  (
    "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
    "\\begin{pmatrix}-1&0\\\\0&-1\\end{pmatrix}",
  ),
  (
    "\\begin{pmatrix} -1/2 \\\\ 1 \\end{pmatrix}",
    "\\begin{pmatrix}-\\frac{1}{2}\\\\1\\end{pmatrix}",
  ),
  ("\\infty", "\\infty"),
  ("\\frac{\\pi}{3}", "\\pi/3"),
  ("\\cos \\theta", "\\cos\\theta"),
  ("\\left[ -\\frac{1}{2}, 3 \\right)", "[-0.5,3)"),
  ("0.333\\overline{3}", "0.333\\overline{3}"),
  ("1000!", "1000\\cdot999!"),
  ("7!!", "105"),
  ("\\log_2 8", "3"),
]

DIFFERENT = [
  ("3", "4"),
  ("0.333", "\\frac13"),
  ("\\pi", "3.14"),
  ("x^2+2x+1", "(x+1)^3"),
  ("[1,2)", "[1,2]"),
  ("(1,2)", "1,2"),
  ("(1,2)", "(2,1)"),
  ("1,2", "1,2,3"),
  ("1,1", "1,2"),
  ("\\text{Monday}", "Tuesday"),
  ("\\frac{1}{2}", "\\frac{1}{3}"),
  ("-5", "5"),
  ("x", "y"),
  ("\\sqrt{2}", "1.414"),
  ("\\infty", "-\\infty"),
  ("y=2x", "y=3x"),
  ("x<1", "x<2"),
  ("\\frac{1}{0}", "1"),
  ("10", "1,0"),
  ("A", "B"),
  ("1\\pm\\sqrt{19}", "1+\\sqrt{19}"),
  ("1\\pm2", "-1, 4"),
  ("1000!", "2000!"),  # past the largest float: compared as sympy numbers, not as inf
]


@pytest.mark.parametrize("pred, gold", EQUAL)
def test_equal_answers(pred, gold):
  assert math_equal(pred, gold), (normalize_latex(pred), normalize_latex(gold))
  assert math_equal(gold, pred)
  assert math_reward(None, [f"Thus $\\boxed{{{pred}}}$."], [gold]) == [1.0]


@pytest.mark.parametrize("pred, gold", DIFFERENT)
def test_different_answers(pred, gold):
  assert not math_equal(pred, gold)
  assert not math_equal(gold, pred)
  assert math_reward(None, [f"\\boxed{{{pred}}}"], [gold]) == [0.0]


@pytest.mark.parametrize(
  "text, boxed",
  [
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed 5$", "5"),
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\boxed{1} and \\boxed{2", None),  # a cut-off last box
    ("\\boxed{", None),
    ("\\boxed", None),
    ("\\boxedx{3}", None),
    ("no box", None),
    ("", None),
    (None, None),
  ],
)
def test_extract_boxed(text, boxed):
  assert extract_boxed(text) == boxed


# Malformed completions: all score 0 against "5", and none raises.
MALFORMED = [
  None,
  5,
  [],
  [{}],
  "",
  "5",
  "The answer is 5.",
  "\\boxed{",
  "\\boxed{5",
  "}}}{{{\\boxed{}",
  "\\boxed{}",
  "\\boxed{٥}",
  "\\boxed{５}",
  "\\boxed{" + "9" * 10000 + "}",
  "\\boxed{" + "{" * 5000 + "5" + "}" * 5000 + "}",
  "\\boxed{\\frac{5}{}}",
  "\\boxed{\\sqrt}",
  "\\boxed{__import__('os').system('echo pwned')}",
  "\\boxed{5'}",
  "\\boxed{x.__class__}",
  "\\boxed{lambda: 5}",
  "\\boxed{\\frac{1}{0}}",
  "\\boxed{0^{-1}}",
  "\\boxed{\\text{6 dollars}}",
  "\\boxed{1e400}",
  "\\boxed{10^{10^{10}}}",
  "\\boxed{" + "(" * 300 + "5" + ")" * 299 + "}",
  "\\boxed{\\begin{pmatrix}5\\end{pmatrix}}",
  "x" * 1_000_000,
]


def test_malformed_completions_score_zero_and_never_raise():
  start = time.monotonic()
  scores = math_reward(None, MALFORMED, ["5"] * len(MALFORMED), timeout=1.0)
  assert scores == [0.0] * len(MALFORMED)
  # One comparison hits the time limit; the rest are quick.
  assert time.monotonic() - start < 30


def test_time_limit_is_kept():
  before = worker_stats()["timeouts"]
  start = time.monotonic()
  # A 4096th power of a sum: cheap to write down, seconds for sympy to simplify.
  assert not math_equal("(x+1)^{2^{12}}", "x^{2^{12}}+1", timeout=0.5)
  assert time.monotonic() - start < 0.5 + 15  # the limit, plus a worker start
  assert worker_stats()["timeouts"] == before + 1
  assert math_equal("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}")  # the restarted worker works


def test_without_sympy():
  assert math_equal("0.5", "\\frac12", symbolic=False)
  assert not math_equal("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", symbolic=False)


def test_format_term():
  completions = ["\\boxed{5}", "\\boxed{4}", "5", "\\boxed{5"]
  assert math_reward(None, completions, ["5"] * 4, format_weight=0.1) == [1.1, 0.1, 0.0, 0.0]
  assert math_format_reward(None, completions) == [1.0, 1.0, 0.0, 0.0]


def test_reward_accepts_boxed_reference_and_conversations():
  assert math_reward(None, ["\\boxed{5}"], ["\\boxed{5}"]) == [1.0]
  assert math_reward(None, [[{"role": "assistant", "content": "\\boxed{5}"}]], ["5"]) == [1.0]
  with pytest.raises(ValueError):
    math_reward(None, ["a"], ["1", "2"])
  assert DEFAULT_TIMEOUT > 0
