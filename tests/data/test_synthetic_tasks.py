"""Synthetic tasks: gold solutions checked line by line by independent parsers, exact rewards,
determinism, held-out test problems, the knobs, and the completion lengths the docs quote."""

import re

import pytest
from hypothesis import given, settings, strategies as st

from jetrl.data import Problem, get_task

SETTINGS = settings(max_examples=200, deadline=None)
splits = st.sampled_from(["train", "test"])
indices = st.integers(0, 10**9)
seeds = st.integers(0, 2**31)


# ---- independent checkers of the written formats -------------------------------------------


def check_addition(p: Problem, difficulty: int, length: int):
  m = re.fullmatch(r"(\d+(?:\+\d+)+)\n", p.prompt)
  assert m, p.prompt
  nums = m.group(1).split("+")
  assert len(nums) == difficulty + 1 and all(len(n) == length and n[0] != "0" for n in nums)
  lines = p.solution.split("\n")
  assert len(lines) == length + 1
  carry, digits = 0, ""
  for col, line in enumerate(lines[:-1]):
    m = re.fullmatch(r"(\d(?:\+\d)+)\+(\d)=(\d+) (\d+)", line)
    assert m, line
    terms = [int(d) for d in m.group(1).split("+")]
    assert terms == [int(n[length - 1 - col]) for n in nums]
    assert int(m.group(2)) == carry
    total = sum(terms) + carry
    assert int(m.group(3)) == total and m.group(3) == str(total)
    digits = str(total % 10) + digits
    assert m.group(4) == digits
    carry = total // 10
  expected = str(sum(int(n) for n in nums))
  assert p.answer == expected
  assert lines[-1] == "answer: " + expected


def check_multiplication(p: Problem, difficulty: int, length: int):
  m = re.fullmatch(r"(\d+)\*(\d+)\n", p.prompt)
  assert m, p.prompt
  a, b = m.group(1), m.group(2)
  assert len(a) == difficulty and len(b) == length and a[0] != "0" and b[0] != "0"
  lines = p.solution.split("\n")
  assert len(lines) == length + 1
  running = 0
  for place, line in enumerate(lines[:-1]):
    m = re.fullmatch(r"(\d+)\*(\d)(0*)=(\d+) (\d+)", line)
    assert m, line
    assert m.group(1) == a and m.group(2) == b[length - 1 - place] and len(m.group(3)) == place
    partial = int(a) * int(m.group(2) + m.group(3))
    running += partial
    assert m.group(4) == str(partial) and m.group(5) == str(running)
  assert p.answer == str(int(a) * int(b))
  assert lines[-1] == "answer: " + p.answer


def check_sorting(p: Problem, difficulty: int, length: int):
  m = re.fullmatch(r"sort (\d+(?: \d+)*)\n", p.prompt)
  assert m, p.prompt
  items = [int(x) for x in m.group(1).split(" ")]
  assert len(items) == length and all(0 <= x < 10**difficulty for x in items)
  lines = p.solution.split("\n")
  assert len(lines) == length * (length - 1) // 2 + (length - 1) + 1
  state, k = list(items), 0
  for done in range(1, length):
    for j in range(length - done):
      m = re.fullmatch(r"(\d+)([<>=])(\d+)", lines[k])
      assert m, lines[k]
      x, op, y = int(m.group(1)), m.group(2), int(m.group(3))
      assert (x, y) == (state[j], state[j + 1])
      assert op == ("<" if x < y else ">" if x > y else "=")
      if x > y:
        state[j], state[j + 1] = y, x
      k += 1
    assert lines[k] == "= " + " ".join(map(str, state))
    k += 1
  assert p.answer == " ".join(map(str, sorted(items)))
  assert lines[-1] == "answer: " + p.answer


CHECKERS = {
  "addition": check_addition,
  "multiplication": check_multiplication,
  "sorting": check_sorting,
}
knobs = {
  "addition": (st.integers(1, 9), st.integers(1, 30)),
  "multiplication": (st.integers(1, 8), st.integers(1, 12)),
  "sorting": (st.integers(1, 6), st.integers(2, 12)),
}


def corrupt(answer: str, position: int) -> str:
  """The answer with one digit changed."""
  digits = [i for i, c in enumerate(answer) if c.isdigit()]
  i = digits[position % len(digits)]
  return answer[:i] + str((int(answer[i]) + 1 + position % 9) % 10) + answer[i + 1 :]


@pytest.mark.parametrize("name", list(CHECKERS))
@SETTINGS
@given(data=st.data(), split=splits, index=indices, seed=seeds, where=st.integers(0, 100))
def test_gold_solutions_are_right_and_score_one(name, data, split, index, seed, where):
  difficulty = data.draw(knobs[name][0])
  length = data.draw(knobs[name][1])
  task = get_task(name, difficulty=difficulty, length=length, seed=seed)
  p = task.problem(split, index)
  CHECKERS[name](p, difficulty, length)
  assert len(p.solution) <= task.max_completion_chars
  assert task.reward([p.prompt], [p.solution], [p.answer]) == [1.0]
  bad = p.solution[: p.solution.rindex("answer: ")] + "answer: " + corrupt(p.answer, where)
  assert task.reward([p.prompt], [bad], [p.answer]) == [0.0]
  assert task.reward(None, [p.solution], [corrupt(p.answer, where)]) == [0.0]


def test_documented_examples():
  add = get_task("addition").solve((4821, 9374))
  assert add == Problem(
    "4821+9374\n", "14195", "1+4+0=5 5\n2+7+0=9 95\n8+3+0=11 195\n4+9+1=14 4195\nanswer: 14195"
  )
  mul = get_task("multiplication").solve((123, 45))
  assert mul == Problem("123*45\n", "5535", "123*5=615 615\n123*40=4920 5535\nanswer: 5535")
  srt = get_task("sorting").solve((52, 7, 31, 9))
  assert srt.prompt == "sort 52 7 31 9\n" and srt.answer == "7 9 31 52"
  assert srt.solution == (
    "52>7\n52>31\n52>9\n= 7 31 9 52\n7<31\n31>9\n= 7 9 31 52\n7<9\n= 7 9 31 52\nanswer: 7 9 31 52"
  )
  three = get_task("addition", difficulty=2).solve((999, 999, 999))
  assert three.answer == "2997" and three.solution.endswith("9+9+9+2=29 997\nanswer: 2997")
  zero = get_task("multiplication").solve((12, 301))
  assert zero.solution == "12*1=12 12\n12*00=0 12\n12*300=3600 3612\nanswer: 3612"


@pytest.mark.parametrize(
  "completion, score",
  [
    ("answer: 14195", 1.0),
    ("junk\nanswer: 14195\n", 1.0),
    ("answer: 14195  \n\n", 1.0),
    ("answer: 14195\nanswer: 1", 0.0),  # the last answer line counts
    ("answer: 14195\nmore", 0.0),  # the answer must be the last line
    ("answer:14195", 0.0),
    ("answer:  14195", 0.0),
    (" answer: 14195", 0.0),
    ("Answer: 14195", 0.0),
    ("answer: 014195", 0.0),
    ("answer: 14,195", 0.0),
    ("answer: 14195.0", 0.0),
    ("answer: ١٤١٩٥", 0.0),
    ("14195", 0.0),
    ("", 0.0),
    (None, 0.0),
    (14195, 0.0),
    ([{"role": "assistant", "content": "x\nanswer: 14195"}], 1.0),
    ("answer: " + "9" * 100_000, 0.0),
  ],
)
def test_exact_reward(completion, score):
  task = get_task("addition", length=4)
  assert task.reward(None, [completion], ["14195"]) == [score]


def test_format_weight():
  task = get_task("sorting", format_weight=0.25)
  out = task.reward(
    None, ["x\nanswer: 1 2 3", "answer: 3 2 1", "answer: 1,2", "nothing"], ["1 2 3"] * 4
  )
  assert out == [1.25, 0.25, 0.0, 0.0]
  assert get_task("sorting").reward(None, ["answer: 3 2 1"], ["1 2 3"]) == [0.0]


def test_reward_argument_lengths_must_match():
  with pytest.raises(ValueError):
    get_task("addition").reward(None, ["a", "b"], ["1"])


@pytest.mark.parametrize("name", list(CHECKERS))
def test_deterministic_and_seeded(name):
  a, b = get_task(name, seed=1), get_task(name, seed=1)
  assert [a.problem("train", i) for i in range(20)] == [b.problem("train", i) for i in range(20)]
  assert a.batch("test", 5, 3) == [b.problem("test", i) for i in (5, 6, 7)]
  other = get_task(name, seed=2)
  assert [a.problem("train", i) for i in range(20)] != [
    other.problem("train", i) for i in range(20)
  ]
  assert a.num_problems("train") is None


@pytest.mark.parametrize(
  "name, difficulty, length",
  [
    ("addition", 1, 1),
    ("addition", 1, 2),
    ("multiplication", 1, 1),
    ("multiplication", 2, 1),
    ("sorting", 1, 2),
    ("sorting", 1, 3),
    ("addition", 2, 5),
    ("sorting", 3, 6),
  ],
)
def test_train_and_test_are_disjoint(name, difficulty, length):
  prompts = {}
  for split in ("train", "test"):
    for seed in (0, 1):
      task = get_task(name, difficulty=difficulty, length=length, seed=seed)
      problems = task.batch(split, 0, 300)
      assert all(task.is_test_problem(p) == (split == "test") for p in problems)
      prompts.setdefault(split, set()).update(p.prompt for p in problems)
  assert prompts["train"] and prompts["test"]
  assert not prompts["train"] & prompts["test"]


@pytest.mark.parametrize(
  "name, kwargs",
  [
    ("addition", {"difficulty": 0}),
    ("addition", {"difficulty": 10}),
    ("addition", {"length": 0}),
    ("addition", {"length": 2.0}),
    ("addition", {"length": True}),
    ("multiplication", {"difficulty": 21}),
    ("sorting", {"length": 1}),
    ("sorting", {"difficulty": "2"}),
    ("addition", {"seed": 1.5}),
  ],
)
def test_bad_knobs(name, kwargs):
  with pytest.raises(ValueError):
    get_task(name, **kwargs)


def test_bad_split_and_index():
  task = get_task("addition")
  for split, index in [("valid", 0), ("train", -1), ("train", 1.0), ("train", True)]:
    with pytest.raises(ValueError):
      task.problem(split, index)


# The lengths docs/tasks.md quotes (from `python -m jetrl.data.lengths`): mean gold completion
# chars over 200 train problems at seed 0, within 5%.
DOCUMENTED = [
  ("addition", 1, 3, 46),
  ("addition", 1, 16, 313),
  ("addition", 1, 36, 1053),
  ("multiplication", 3, 2, 47),
  ("multiplication", 3, 8, 223),
  ("multiplication", 3, 22, 1039),
  ("sorting", 2, 3, 54),
  ("sorting", 2, 8, 370),
  ("sorting", 2, 13, 977),
  ("sorting", 5, 6, 404),
]


@pytest.mark.parametrize("name, difficulty, length, mean", DOCUMENTED)
def test_documented_lengths(name, difficulty, length, mean):
  task = get_task(name, difficulty=difficulty, length=length)
  sizes = [len(task.problem("train", i).solution) for i in range(200)]
  assert abs(sum(sizes) / len(sizes) - mean) <= 0.05 * mean
  assert max(sizes) <= task.max_completion_chars


def test_length_knob_spans_50_to_1000_chars():
  for name in CHECKERS:
    task = get_task(name)
    short = get_task(name, length=task.length_range[0] + 1)
    long = get_task(name, length=min(task.length_range[1], 64))
    assert len(short.problem("train", 0).solution) <= 80
    assert len(long.problem("train", 0).solution) >= 1000


def test_misreport_changes_only_the_last_answer_character():
  from jetrl.data.synthetic import misreport

  task = get_task("addition", difficulty=1, length=2)
  p = task.solve((19, 20))  # 39
  bad = misreport(p, task.answer_chars)
  assert (bad.prompt, bad.answer) == (p.prompt, "39")
  assert bad.solution == p.solution[: -len("answer: 39")] + "answer: 30"  # '9' wraps to '0'
  assert task.reward(None, [p.solution, bad.solution], ["39", "39"]) == [1.0, 0.0]
  assert misreport(task.solve((10, 25)), task.answer_chars).solution.endswith("answer: 36")
  with pytest.raises(ValueError, match="does not end with 'answer: '"):
    misreport(Problem("1+1\n", "2", "1+1=2"), task.answer_chars)
