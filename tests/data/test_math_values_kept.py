"""MATH normalisation never changes a value: unit words are dropped only where they are units
(never by joining the numbers around them, never with a power that is not theirs), a `name=`
prefix only where it names what the gold names (or the gold is a bare value), and
`\\sin^{-1}` and kin are inverse functions while `\\sin^2 x` stays a power. Expectations by
hand."""

import pytest

from jetrl.data import math_equal, math_reward


@pytest.mark.parametrize(
  "pred, gold",
  [
    ("5\\text{ m }2", "52"),
    ("2 \\text{ m} 3", "23"),
    ("3 \\text{ sq } 4", "34"),
    ("5 \\text{ per } 3", "53"),
    ("5 \\text{cm}^2 3", "53"),
    ("5\\text{ m}\\text{ }2", "52"),
    ("5\\text{ cm}^{23}", "53"),
    ("5\\text{ cm}^{2x}", "5x"),
    ("2\\text{ m}^3 + 1", "3"),
    ("5 \\text{ m}^2 \\cdot 3", "15"),
    ("2 s^2", "2"),  # a variable s squared, not seconds
    ("4 h", "4"),
  ],
)
def test_unit_words_never_join_or_drop_values(pred, gold):
  assert not math_equal(pred, gold)


@pytest.mark.parametrize(
  "pred, gold",
  [
    ("5 \\text{ cm}^2", "5"),
    ("5 \\text{ cm}^{2}", "5"),
    ("12 \\text{ square units}", "12"),
    ("10 \\text{ in}.", "10"),
    ("3 \\text{ m}", "3"),
    ("5 cm^2", "5"),
    ("7 \\text{ cm} \\text{ squared}", "7"),
    ("\\frac{1}{2} \\text{ inches}", "\\frac12"),
  ],
)
def test_units_at_the_end_are_still_dropped(pred, gold):
  assert math_equal(pred, gold)


@pytest.mark.parametrize(
  "pred, gold, equal",
  [
    ("y=5", "x=5", False),
    ("x=5", "y=5", False),
    ("a=3", "b=3", False),
    ("x \\in [0,1]", "y \\in [0,1]", False),
    ("y = 2x+1", "x = 2y+1", False),
    ("x=5", "x=5", True),
    ("x = 5", "5", True),  # a bare gold: any name for the value
    ("5", "x=5", True),
    ("k=-3", "-3", True),
    ("x \\in [1, 2]", "[1,2]", True),
    ("y=2x+3", "y=3+2x", True),
    ("y = 2x+3", "2x + 3", True),
  ],
)
def test_a_name_prefix_is_stripped_only_for_the_same_name(pred, gold, equal):
  assert math_equal(pred, gold) is equal


@pytest.mark.parametrize(
  "pred, gold, equal",
  [
    ("\\sin^{-1}(1/2)", "\\frac{\\pi}{6}", True),
    ("\\sin^{-1}\\frac{1}{2}", "\\arcsin\\frac12", True),
    ("\\cos^{-1}(0)", "\\frac{\\pi}{2}", True),
    ("\\tan^{-1} 1", "\\frac{\\pi}{4}", True),
    ("\\sin^{-1}(1/2)", "\\frac{1}{\\sin(1/2)}", False),
    ("\\tan^{-1}(1)", "\\cot(1)", False),
    ("\\sin^2 x", "(\\sin x)^2", True),
    ("\\sin^2 x", "1-\\cos^2 x", True),
    ("\\sin^2 x", "\\sin(x^2)", False),
  ],
)
def test_inverse_function_superscript(pred, gold, equal):
  assert math_equal(pred, gold) is equal
  assert math_reward(None, [f"\\boxed{{{pred}}}"], [gold]) == [1.0 if equal else 0.0]
