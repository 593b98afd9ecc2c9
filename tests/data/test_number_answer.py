"""The number-answer grammar (GSM8K, chat_arithmetic): an answer slot (`\\boxed{}`, the `####`
line) holds exactly one number in an accepted spelling, else no answer. Every expectation is
written by hand; docs/tasks.md has the table of spellings."""

import pytest

from jetrl.data import get_task, gsm8k_reward
from jetrl.data.number_answer import read_number

MINUS = "\u2212"


def gsm8k(completion, gold):
  return gsm8k_reward(None, [completion], [gold])[0]


def chat(completion, gold):
  return get_task("chat_arithmetic").reward(None, [completion], [gold])[0]


# A function, an operator or another numeral around the gold's digits is not the gold.
COMPUTED = [
  ("\\boxed{5!}", "120"),
  ("\\boxed{5!}", "5"),
  ("\\boxed{\\sqrt{144}}", "12"),
  ("\\boxed{\\sqrt{144}}", "144"),
  ("\\boxed{\\log_2 8}", "8"),
  ("\\boxed{\\log_2 8}", "2"),
  ("\\boxed{2^3}", "2"),
  ("\\boxed{2^3}", "8"),
  ("\\boxed{3 \\times 4}", "4"),
  ("\\boxed{3 \\times 4}", "12"),
  ("\\boxed{3 \\cdot 4}", "3"),
  ("\\boxed{\\frac{12}{1}}", "12"),
  ("\\boxed{-(12)}", "12"),
  ("\\boxed{|-12|}", "-12"),
  ("\\boxed{12^{\\circ}}", "12"),
  ("\\boxed{x = 12}", "12"),
  ("\\boxed{13\\boxed{12}}", "13"),  # the last box is the inner one
  ("#### 2^3", "2"),
  ("#### 5!", "5"),
  ("#### 12 \\times 1", "12"),
  ("#### 12*1", "12"),
  ("#### 1e5", "1"),
  ("\\boxed{1.2e3}", "1.2"),
  ("\\boxed{1.2 \\times 10^3}", "1.2"),
]


@pytest.mark.parametrize("completion, gold", COMPUTED)
def test_an_expression_around_the_digits_is_no_answer(completion, gold):
  assert gsm8k(completion, gold) == 0.0
  if completion.startswith("\\boxed"):  # chat_arithmetic has no `####` line
    assert chat(completion, gold) == 0.0


# Words, other numerals and non-ASCII digits beside the gold: a hedge, no answer.
HEDGES = [
  ("#### 12 or thirteen", "12"),
  ("#### 12 (or 13)", "12"),
  ("#### 12 or 13", "12"),
  ("#### 12 or 13", "13"),
  ("#### 12 or １３", "12"),
  ("#### 12 ١٣", "12"),
  ("#### 1२", "1"),
  ("#### 12٣", "12"),
  ("#### 12 dollars", "12"),
  ("\\boxed{12 \\text{ or thirteen}}", "12"),
  ("\\boxed{12 \\text{ apples}}", "12"),
  ("\\boxed{12 or 13}", "12"),
  ("\\boxed{12 \\text{ or } １３}", "12"),
  ("\\boxed{twelve}", "12"),
  ("\\boxed{12, 13}", "12"),
  ("\\boxed{12; 13}", "13"),
  ("\\boxed{12/13}", "12"),
  ("\\boxed{12 \\text{ or } 13}", "13"),
  ("\\boxed{１２}", "12"),
  ("\\boxed{12\u00b2}", "12"),
]


@pytest.mark.parametrize("completion, gold", HEDGES)
def test_words_and_other_numerals_in_the_slot_are_no_answer(completion, gold):
  assert gsm8k(completion, gold) == 0.0
  if completion.startswith("\\boxed"):
    assert chat(completion, gold) == 0.0


def test_a_hedged_hash_line_does_not_fall_back_to_a_box():
  # The `####` line is the answer slot (it comes first in the order); when it holds no
  # number the box is not read instead.
  assert gsm8k("\\boxed{12}\n#### 12 or 13", "12") == 0.0
  assert gsm8k("\\boxed{12}\n#### 12", "12") == 1.0


def test_unicode_minus_is_a_sign():
  assert gsm8k(f"#### {MINUS}12", "12") == 0.0
  assert gsm8k(f"#### {MINUS}12", "-12") == 1.0
  assert gsm8k("#### -12", f"{MINUS}12") == 1.0
  assert gsm8k("#### 12", f"{MINUS}12") == 0.0
  assert gsm8k(f"\\boxed{{{MINUS}12}}", "12") == 0.0
  assert gsm8k(f"\\boxed{{{MINUS}12}}", "-12") == 1.0
  assert gsm8k(f"so x is {MINUS}12", "12") == 0.0  # the last number of the text
  assert gsm8k(f"so x is {MINUS}12", "-12") == 1.0
  assert chat(f"\\boxed{{{MINUS}12}}", "12") == 0.0
  assert chat(f"the answer: {MINUS}12", "12") == 0.0
  assert gsm8k(f"#### {MINUS}{MINUS}12", "12") == 0.0
  assert gsm8k(f"#### -{MINUS}12", "-12") == 0.0


# Right answers in accepted spellings.
RIGHT = [
  ("\\boxed{1\\,080}", "1080"),
  ("\\boxed{1{,}080}", "1080"),
  ("\\boxed{1,\\!080}", "1080"),
  ("\\boxed{1\\,000\\,000}", "1000000"),
  ("\\boxed{10{,}000.5}", "10000.5"),
  ("#### 1\\,080", "1080"),
  ("#### 1{,}080", "1080"),
  ("so the total is 1{,}080", "1080"),
  ("so the total is 1\\,080", "1080"),
  ("\\boxed{-\\!12}", "-12"),
  ("\\boxed{\\text{12}}", "12"),
  ("\\boxed{\\textbf{12}}", "12"),
  ("\\boxed{$12$}", "12"),
  ("\\boxed{12.}", "12"),
  ("\\boxed{012}", "12"),
  ("\\boxed{{12}}", "12"),
  ("\\boxed{\\$12.50}", "12.5"),
  ("\\boxed{-\\$12}", "-12"),
  ("\\boxed{50\\%}", "50"),
  ("#### 50%.", "50"),
  ("#### $1,080.", "1080"),
]


@pytest.mark.parametrize("completion, gold", RIGHT)
def test_accepted_spellings_of_the_gold_score_one(completion, gold):
  assert gsm8k(completion, gold) == 1.0
  assert chat(completion, gold) == 1.0


@pytest.mark.parametrize(
  "slot, value",
  [
    ("12", "12"),
    (" 12 ", "12"),
    ("+12", "12"),
    (f"{MINUS}12", "-12"),
    ("- 12", "-12"),
    ("1,234,567", "1234567"),
    ("1\\,234\\,567", "1234567"),
    ("1{,}234{,}567", "1234567"),
    ("1,234\\,567", None),  # one separator per number
    ("1,2345", None),
    ("12,345,67", None),
    ("0,500", None),  # a leading-zero group: a decimal comma, not thousands
    ("1\\,2", None),
    (".5", "0.5"),
    ("12.500", "12.5"),
    ("12.", "12"),
    ("12..", None),
    ("1.2.3", None),
    ("--12", None),
    ("+-12", None),
    ("\u201312", None),  # an en dash is not a minus sign
    ("1e5", None),
    ("10^5", None),
    ("0x10", None),
    ("12 13", None),
    ("", None),
    ("\\text{}", None),
    ("\\$", None),
    ("%", None),
    ("\\text{\\textbf{$\\$12$}}", "12"),
    ("9" * 101, None),
    ("9" * 100, "9" * 100),
    (None, None),
  ],
)
def test_read_number(slot, value):
  assert read_number(slot) == value


# Variants beyond the review's examples, each decided by "exactly one number in an accepted
# spelling" (the table in docs/tasks.md).
@pytest.mark.parametrize(
  "completion, gold, score",
  [
    ("\\boxed{12}\\boxed{13}", "12", 0.0),  # the last box is the answer
    ("\\boxed{12}\\boxed{13}", "13", 1.0),
    ("#### 12\n#### 13", "12", 0.0),
    ("#### 12 #### 13", "13", 1.0),
    ("＃＃＃＃ 12 or 13", "12", 0.0),  # no ASCII marker: the last number, 13
    ("＃＃＃＃ 12", "12", 1.0),
    ("#### $$12$$", "12", 1.0),
    ("#### **12**", "12", 1.0),
    ("\\boxed{\\displaystyle 12\\,}", "12", 1.0),
    ("\\boxed{1\\!2}", "12", 0.0),
    ("\\boxed{12\\,13}", "12", 0.0),
    ("\\boxed{12,}", "12", 0.0),
    ("\\boxed{12..}", "12", 0.0),
    ("\\boxed{12.0.}", "12", 1.0),
    ("\\boxed{0012.500}", "12.5", 1.0),
    ("\\boxed{1,2345}", "12345", 0.0),
    ("\\boxed{1,2345}", "1", 0.0),
    ("\\boxed{12\u200b}", "12", 0.0),  # a zero-width space is not a spelling
    ("\\boxed{\U0001d7cf\U0001d7d0}", "12", 0.0),  # mathematical bold digits
    ("\\boxed{12\\text{ }13}", "12", 0.0),
    ("\\boxed{\\phantom{1}2}", "2", 0.0),
    ("#### 12\\%", "12", 1.0),
    ("#### −\\$12", "-12", 1.0),
  ],
)
def test_variants(completion, gold, score):
  assert gsm8k(completion, gold) == score


def test_synthetic_answer_line_is_the_canonical_digits_only():
  task = get_task("addition", difficulty=1, length=2)
  p = task.solve((12, 30))
  assert p.answer == "42"
  lines = ["answer: 42", "answer: 42  ", "answer: 042", "answer: +42", "answer: 4,2", "answer: 42."]
  assert task.reward(None, lines, ["42"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
  assert (
    task.reward(None, ["answer: 42 or 43", "answer: ٤٢", "answer: 4２"], ["42"] * 3) == [0.0] * 3
  )
