"""GSM8K answer extraction and reward: every real reference solution, and hand-written
adversarial completions."""

import pytest

from jetrl.data import canonical_number, gsm8k_answer, gsm8k_reward
from jetrl.data.gsm8k import strip_calculator_annotations
from jetrl.data.rewards import gsm8k_format_reward
from shared_data import GSM8K_DIR, needs_shared, read_jsonl


def final_of(worked: str) -> str:
  """Independent reading of the reference: the text after '#### ', commas dropped."""
  line = worked.strip().split("\n")[-1]
  assert line.startswith("#### ")
  return line[5:].replace(",", "")


@needs_shared
@pytest.mark.parametrize("split, rows", [("train", 7473), ("test", 1319)])
def test_every_reference_solution_scores_one(split, rows):
  data = read_jsonl(GSM8K_DIR / f"{split}.jsonl")
  assert len(data) == rows
  worked = [r["answer"] for r in data]
  finals = [final_of(w) for w in worked]
  # The worked answer against its final number, and against the whole worked answer.
  assert gsm8k_reward(None, worked, finals) == [1.0] * rows
  assert gsm8k_reward(None, worked, worked) == [1.0] * rows
  # Without calculator annotations (the task's gold solution), and boxed instead of ####.
  stripped = [strip_calculator_annotations(w) for w in worked]
  assert all("<<" not in s and ">>" not in s for s in stripped)
  assert gsm8k_reward(None, stripped, finals) == [1.0] * rows
  boxed = [
    s.rsplit("####", 1)[0] + f"So the answer is $\\boxed{{{f}}}$." for s, f in zip(stripped, finals)
  ]
  assert gsm8k_reward(None, boxed, finals) == [1.0] * rows
  # A changed final number scores 0.
  wrong = [s.rsplit("####", 1)[0] + f"#### {int(f) + 1}" for s, f in zip(stripped, finals)]
  assert gsm8k_reward(None, wrong, finals) == [0.0] * rows


# (completion, reference, expected reward): hand-written.
CASES = [
  ("#### 18", "18", 1.0),
  ("so #### $18.", "18", 1.0),
  ("#### 1,080", "1080", 1.0),
  ("#### 1080", "1,080", 1.0),
  ("####18", "18", 1.0),
  ("#### +18", "18", 1.0),
  ("#### 18.00", "18", 1.0),
  ("#### 018", "18", 1.0),
  ("#### -10", "-10", 1.0),
  ("#### - 10", "-10", 1.0),
  ("#### -10", "10", 0.0),
  ("#### 0.50", "0.5", 1.0),
  ("#### .5", "0.5", 1.0),
  ("#### 18.5", "18", 0.0),
  ("#### 18", "18.5", 0.0),
  ("The answer is \\boxed{18}.", "18", 1.0),
  ("The answer is \\boxed{\\$1,080}.", "1080", 1.0),
  ("The answer is \\boxed{18 \\text{ dollars}}", "18", 0.0),  # words in the box: none
  ("\\boxed{18} but #### 20", "20", 1.0),  # #### comes first in the order
  ("\\boxed{18} but #### 20", "18", 0.0),
  ("#### 20\nthen #### 18", "18", 1.0),  # the last #### counts
  ("She has 3 apples, 4 pears, so 7 fruits.", "7", 1.0),  # last number
  ("She has 7 fruits, not 3.", "7", 0.0),
  ("It costs $1,234.50 in total", "1234.5", 1.0),
  ("Between 2017-2018", "2018", 1.0),  # a hyphen between numbers is no sign
  ("x = -4", "-4", 1.0),
  ("", "18", 0.0),
  ("no number here", "18", 0.0),
  ("#### eighteen", "18", 0.0),
  ("#### ١٨", "18", 0.0),  # Arabic-Indic digits are not numbers
  ("#### １８", "18", 0.0),  # fullwidth digits neither
  ("#### " + "9" * 5000, "18", 0.0),  # an enormous number
  ("#### " + "9" * 5000, "9" * 5000, 0.0),  # too long to be an answer at all
  ("\\boxed{18", "18", 1.0),  # unbalanced box: last number is 18
  ("\\boxed{", "18", 0.0),
  ("{{{{}}}}}}\\boxed{}}}", "18", 0.0),
  ("#### 18", "", 0.0),
  ("#### 18", "eighteen", 0.0),
  (None, "18", 0.0),
  (18, "18", 0.0),
  ([{"role": "assistant", "content": "#### 18"}], "18", 1.0),
  ("#### 18", 18, 1.0),
  ("1e5", "100000", 0.0),
  ("#### 1,2", "12", 0.0),  # not a thousands separator
]


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_adversarial(completion, reference, expected):
  assert gsm8k_reward(["prompt"], [completion], [reference]) == [expected]


def test_order_is_configurable():
  text = "\\boxed{18} and later 7 and #### 20"
  assert gsm8k_answer(text) == "20"
  assert gsm8k_answer(text, ("boxed", "hash", "last")) == "18"
  assert gsm8k_answer(text, ("last",)) == "20"
  assert gsm8k_answer("\\boxed{18}, then 7", ("last", "boxed")) == "7"
  assert gsm8k_reward(None, [text], ["18"], order=("boxed",)) == [1.0]
  assert gsm8k_reward(None, ["the answer is 18"], ["18"], order=("hash", "boxed")) == [0.0]
  for bad in [("hash", "hash"), ("nope",), ()]:
    with pytest.raises(ValueError):
      gsm8k_reward(None, ["#### 1"], ["1"], order=bad)


def test_canonical_number():
  table = {
    "1,000": "1000",
    "+7.0": "7",
    "-0": "0",
    "-0.00": "0",
    ".5": "0.5",
    "007": "7",
    "$5": "5",
    "\\$5": "5",
    "5.": None,
    "1e3": None,
    "abc": None,
    "": None,
    "--1": None,
    "1.2.3": None,
    "٣": None,
  }
  assert {k: canonical_number(k) for k in table} == table


def test_format_term():
  completions = ["#### 18", "\\boxed{18}", "18", "#### 17"]
  assert gsm8k_reward(None, completions, ["18"] * 4, format_weight=0.5) == [1.5, 1.5, 1.0, 0.5]
  assert gsm8k_reward(None, completions, ["18"] * 4) == [1.0, 1.0, 1.0, 0.0]
  assert gsm8k_format_reward(None, completions) == [1.0, 1.0, 0.0, 1.0]
