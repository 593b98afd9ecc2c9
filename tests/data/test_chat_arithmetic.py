"""chat_arithmetic: questions checked by an independent parser and integer arithmetic, the
format-checked reward on hand-written completions, the knobs and the held-out split."""

import re

import pytest
from hypothesis import given, settings, strategies as st

from jetrl.data import Problem, get_task
from jetrl.data.chat_arithmetic import final_number

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def check(p: Problem, difficulty: int, length: int) -> None:
  """The prompt parsed and evaluated left to right by hand, the running total never negative,
  and the gold solution's steps and box."""
  question, instruction = p.prompt.split("\n")
  assert instruction == INSTRUCTION
  m = re.fullmatch(r"What is (\d+(?: [+-] \d+)+)\?", question)
  assert m, question
  tokens = m.group(1).split(" ")
  numbers, ops = tokens[0::2], tokens[1::2]
  assert len(numbers) == length + 1
  assert all(len(n) == difficulty and (difficulty == 1 or n[0] != "0") for n in numbers)
  total, steps = int(numbers[0]), []
  for op, n in zip(ops, numbers[1:]):
    new = total + int(n) if op == "+" else total - int(n)
    assert new >= 0
    steps.append(f"{total} {op} {n} = {new}")
    total = new
  assert p.answer == str(total)
  assert p.solution == ", ".join(steps) + f". The answer is \\boxed{{{total}}}."


@settings(max_examples=200, deadline=None)
@given(
  difficulty=st.integers(1, 6),
  length=st.integers(1, 6),
  split=st.sampled_from(["train", "test"]),
  index=st.integers(0, 10**9),
  seed=st.integers(0, 2**31),
)
def test_problems_are_right_and_their_gold_solutions_score_one(
  difficulty, length, split, index, seed
):
  task = get_task("chat_arithmetic", difficulty=difficulty, length=length, seed=seed)
  p = task.problem(split, index)
  check(p, difficulty, length)
  assert len(p.solution) <= task.max_completion_chars
  assert task.reward([p.prompt], [p.solution], [p.answer]) == [1.0]
  wrong = str(int(p.answer) + 1)
  assert task.reward(None, [p.solution.replace(f"{{{p.answer}}}", f"{{{wrong}}}")], [p.answer]) == [
    0.0
  ]


def test_documented_example():
  p = get_task("chat_arithmetic").solve(((47, 38, 12), ("+", "-")))
  assert p == Problem(
    f"What is 47 + 38 - 12?\n{INSTRUCTION}",
    "73",
    "47 + 38 = 85, 85 - 12 = 73. The answer is \\boxed{73}.",
  )


@pytest.mark.parametrize(
  "completion, score",
  [
    ("3 + 4 + 5 = 12", 1.0),  # no box: the last number
    ("3 + 4 = 7, 7 + 5 = 12.", 1.0),
    ("The answer is \\boxed{12}.", 1.0),
    ("\\boxed{12} and then 13", 1.0),  # a box decides over a later number
    ("12, or rather \\boxed{13}", 0.0),
    ("3 + 4 + 5 = 12\nThe answer is within \\boxed{}.", 0.0),  # an empty box: no answer
    ("\\boxed{+12}", 1.0),
    ("\\boxed{12.0}", 1.0),
    ("\\boxed{1 2}", 0.0),
    ("\\boxed{12", 0.0),  # a cut-off box: no answer, and not its number either
    ("3 + 4 + 5 = 11", 0.0),
    ("", 0.0),
    ("twelve", 0.0),
    ("١٢", 0.0),  # Arabic-Indic digits are not a number here
    (None, 0.0),
    ([{"role": "assistant", "content": "= 12"}], 1.0),
  ],
)
def test_reward_reads_the_last_box_else_the_last_number(completion, score):
  task = get_task("chat_arithmetic")
  assert task.reward(None, [completion], ["12"]) == [score]


def test_final_number_and_format_weight():
  assert final_number("so -3") == "-3" and final_number("1,000") == "1000"
  assert final_number("nothing") is None and final_number(7) is None
  task = get_task("chat_arithmetic", format_weight=0.25)
  assert task.reward(None, ["\\boxed{5}", "12", "\\boxed{12}", "x"], ["12"] * 4) == [
    0.25,
    1.0,
    1.25,
    0.0,
  ]


def test_seeded_deterministic_and_held_out():
  a, b = get_task("chat_arithmetic", seed=1), get_task("chat_arithmetic", seed=1)
  assert a.batch("train", 0, 20) == b.batch("train", 0, 20)
  assert a.batch("train", 0, 20) != get_task("chat_arithmetic", seed=2).batch("train", 0, 20)
  for d, n in ((1, 1), (1, 2), (2, 1)):
    task = get_task("chat_arithmetic", difficulty=d, length=n)
    train = {p.prompt for p in task.batch("train", 0, 300)}
    test = {p.prompt for p in task.batch("test", 0, 300)}
    assert train and test and not train & test


def test_longest_completion_is_the_all_additions_one():
  task = get_task("chat_arithmetic", difficulty=2, length=2)
  assert task.max_completion_chars == len(
    "99 + 99 = 198, 198 + 99 = 297. The answer is \\boxed{297}."
  )


@pytest.mark.parametrize(
  "kwargs", [{"difficulty": 0}, {"difficulty": 7}, {"length": 0}, {"length": 7}]
)
def test_bad_knobs(kwargs):
  with pytest.raises(ValueError, match="chat_arithmetic: (difficulty|length) must be an int in"):
    get_task("chat_arithmetic", **kwargs)
