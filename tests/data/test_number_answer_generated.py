"""Generated attacks on the number-answer grammar (GSM8K, chat_arithmetic): every accepted
spelling of the gold scores 1; text, operators, words and other numerals around or inside the
answer slot never score 1; any slot the grammar reads holds no letter, operator or non-ASCII
digit, and its value is its own digits. Fixed seed (derandomize) and a bounded number of
examples, so the suite is stable and takes seconds."""

from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetrl.data import get_task, gsm8k_reward
from jetrl.data.number_answer import read_number

SUITE = settings(
  max_examples=200,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)
MINUS = "\u2212"
SEPARATORS = [",", "\\,", "{,}", ",\\!"]
WRAPPERS = [
  "{}",
  "\\text{{{}}}",
  "\\textbf{{{}}}",
  "\\mathrm{{{}}}",
  "${}$",
  "\\({}\\)",
  "{{{}}}",
]
CHAT = get_task("chat_arithmetic")


@st.composite
def golds(draw):
  """(sign, integer digits, fraction digits) of a gold number; integer part without leading
  zeros."""
  whole = draw(st.integers(0, 10**12))
  frac = draw(st.sampled_from(["", "", "5", "25", "125", "05"]))
  negative = draw(st.booleans()) and (whole or frac)
  return ("-" if negative else ""), str(whole), frac


def canonical(gold) -> str:
  sign, whole, frac = gold
  return sign + whole + ("." + frac if frac else "")


@st.composite
def spellings(draw, gold):
  """One accepted spelling of the gold, chosen independently of the code under test."""
  sign, whole, frac = gold
  if len(whole) > 3 and draw(st.booleans()):
    sep = draw(st.sampled_from(SEPARATORS))
    head = len(whole) % 3 or 3
    groups = [whole[:head]] + [whole[k : k + 3] for k in range(head, len(whole), 3)]
    digits = sep.join(groups)
  else:
    digits = "0" * draw(st.integers(0, 2)) + whole
  if frac:
    digits += "." + frac + "0" * draw(st.integers(0, 2))
  elif draw(st.booleans()):
    digits += "." + "0" * draw(st.integers(1, 3))
  if sign:
    sign = draw(st.sampled_from(["-", MINUS, "- ", "-\\!"]))
  elif draw(st.booleans()):
    sign = "+"
  wrapper = draw(st.sampled_from(WRAPPERS))
  currency = draw(st.sampled_from(["", "", "\\$", "$"]))
  if wrapper == "${}$" and currency == "$":  # a dollar inside math mode is written \$
    currency = "\\$"
  body = sign + currency + digits if draw(st.booleans()) else currency + sign + digits
  if draw(st.booleans()):
    body += draw(st.sampled_from(["\\%", "%"]))
  body = wrapper.format(body)
  if draw(st.booleans()):
    body += "."
  return body


@st.composite
def spelled_golds(draw):
  gold = draw(golds())
  return gold, draw(spellings(gold))


@SUITE
@given(spelled_golds(), st.sampled_from(["box", "hash"]))
def test_every_accepted_spelling_of_the_gold_scores_one(spelled, slot):
  gold, spelling = spelled
  completion = f"So \\boxed{{{spelling}}}" if slot == "box" else f"Thus\n#### {spelling}"
  assert gsm8k_reward(None, [completion], [canonical(gold)]) == [1.0]
  if slot == "box":
    assert CHAT.reward(None, [completion], [canonical(gold)]) == [1.0]


# Tokens that cannot be part of an accepted spelling: words, operators, functions, another
# numeral (after a space), digits of other scripts.
JUNK = [
  " or 13",
  " or thirteen",
  "thirteen",
  " apples",
  "\\text{ or 13}",
  "\\text{ or }",
  " 13",
  "١٣",
  "１３",
  "२",
  "\u00b2",
  "!",
  "^2",
  "^{2}",
  "\\times 1",
  "*1",
  "/1",
  "+1",
  "-1",
  "=",
  "x=",
  "\\sqrt",
  "\\log_{10}",
  "e0",
  "\\cdot 1",
  "(",
  ")",
  "|",
  "; 13",
  ", 13",
  "\\pm",
  "\\approx",
]


@SUITE
@given(
  golds(),
  st.lists(st.sampled_from(JUNK), min_size=0, max_size=3),
  st.lists(st.sampled_from(JUNK), min_size=0, max_size=3),
  st.sampled_from(["box", "hash"]),
)
def test_junk_around_the_gold_never_scores_one(gold, before, after, slot):
  if not before and not after:
    after = [" or 13"]
  body = "".join(before) + canonical(gold) + "".join(after)
  if slot == "box":
    completions = [f"So \\boxed{{{body}}}", f"\\boxed{{{canonical(gold)}}} then \\boxed{{{body}}}"]
  else:
    completions = [f"#### {body}", f"\\boxed{{{canonical(gold)}}}\n#### {body}"]
  for completion in completions:
    assert gsm8k_reward(None, [completion], [canonical(gold)]) == [0.0], completion
    if slot == "box":
      assert CHAT.reward(None, [completion], [canonical(gold)]) == [0.0], completion


@SUITE
@given(golds(), st.integers(0, 3), st.sampled_from(JUNK))
def test_junk_inside_the_number_never_scores_one(gold, where, junk):
  digits = canonical(gold)
  cut = min(where + 1, len(digits))
  body = digits[:cut] + junk + digits[cut:]
  for completion in (f"\\boxed{{{body}}}", f"#### {body}"):
    assert gsm8k_reward(None, [completion], [digits]) == [0.0], completion


SLOT_CHARS = "0123456789" * 3 + " ,.-+$%{}\\!tex\u2212١２²=^*x"
SLOT_WORDS = ["\\text{", "\\,", "{,}", "\\$", "\\%", "\\!", "$", "12", "1,000", "or"]


@SUITE
@given(st.lists(st.sampled_from(list(SLOT_CHARS) + SLOT_WORDS), max_size=20))
def test_whatever_the_grammar_reads_is_only_a_number(parts):
  """Any slot it reads holds nothing but digits, separators and decorations, and its value
  is the slot's own ASCII digits with the sign and the point where the slot has them."""
  slot = "".join(parts)
  value = read_number(slot)
  if value is None:
    return
  assert not any(c.isdigit() and c not in "0123456789" for c in slot)
  rest = slot
  for word in ("\\textbf", "\\text", "\\mathrm", "\\("):
    rest = rest.replace(word, "")
  assert not any(c.isalpha() for c in rest), slot
  assert not any(c in "=^*²" for c in rest), slot
  digits = "".join(c for c in slot if c in "0123456789")
  point = slot.find(".")
  decimals = 0
  if point >= 0 and any(c in "0123456789" for c in slot[point:]):
    decimals = sum(c in "0123456789" for c in slot[point:])
  expected = Fraction(int(digits), 10**decimals)
  if "-" in slot or MINUS in slot:
    expected = -expected
  assert Fraction(value) == expected, slot
