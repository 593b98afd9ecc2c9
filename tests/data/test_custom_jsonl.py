"""`--task.name=jsonl`: a JSON-lines file of your own, its fields named by flags and its
answers checked as a number, a MATH answer or an exact string; bad rows and flags are errors
that name the flag."""

from __future__ import annotations

import json

import pytest

from conftest import parse_flags
from jetrl.config import ConfigError, FlagError
from jetrl.data import get_task
from jetrl.train import pieces

ROWS = [
  {"q": "How many legs have 3 cats?", "a": 12, "why": "3 * 4 = 12\n#### 12"},
  {"q": "Half of 1/3?", "a": "\\frac{1}{6}", "why": "1/3 / 2 = \\boxed{\\frac{1}{6}}"},
  {"q": "Capital of France?", "a": "Paris", "why": "It is \\boxed{Paris}"},
]


def write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def task(path, checker, **kw):
  return get_task("jsonl", path=path, prompt_field="q", answer_field="a", checker=checker, **kw)


def test_each_checker_scores_hand_made_completions(tmp_path):
  numbers = write(tmp_path / "n.jsonl", [{"q": f"What is {i} + 1?", "a": i + 1} for i in range(10)])
  t = task(numbers, "number")
  assert (t.num_problems("train"), t.num_problems("test")) == (8, 2)
  p = t.problem("test", 0)
  assert p.prompt.startswith("Question: What is ") and '"#### <number>"' in p.prompt
  assert t.reward(
    None, ["so it is\n#### 1,000", "\\boxed{1000}", "1000.5", "it is 7"], ["1000"] * 4
  ) == [
    1.0,
    1.0,
    0.0,
    0.0,
  ]
  maths = task(write(tmp_path / "m.jsonl", ROWS[1:2] * 5), "math")
  assert maths.problem("train", 0).prompt.startswith("Problem: Half of 1/3?")
  assert maths.reward(None, ["\\boxed{1/6}", "\\boxed{0.5}", "1/6"], ["\\frac{1}{6}"] * 3) == [
    1.0,
    0.0,
    0.0,
  ]
  exact = task(write(tmp_path / "e.jsonl", ROWS[2:] * 5), "exact")
  completions = ["It is \\boxed{Paris}", "#### Paris \nmore", "I think\n Paris ", "\\boxed{paris}"]
  assert exact.reward(None, completions, ["Paris"] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_the_solution_field_gives_the_warm_starts_solutions(tmp_path):
  t = task(write(tmp_path / "d.jsonl", ROWS[:1] * 5), "number", solution_field="why", shuffle=False)
  assert t.problem("train", 0).solution == "3 * 4 = 12\n#### 12"
  assert t.problem("train", 0).answer == "12"


@pytest.mark.parametrize(
  "rows, kw, message",
  [
    (
      [{"question": "x", "a": 1}],
      {},
      r"d.jsonl:1: no field 'q' \(--task.prompt_field=q\); the row's fields are \['a', 'question'\]",
    ),
    ([{"q": "x", "answer": 1}], {}, r"no field 'a' \(--task.answer_field=a\)"),
    ([{"q": "", "a": 1}], {}, r"d.jsonl:1: field 'q': must be a non-empty string"),
    ([{"q": "x", "a": None}], {}, r"field 'a': must be a non-empty string or a number"),
    ([{"q": "x", "a": "Paris"}], {}, r"'Paris' is not a number \(--task.checker=number\)"),
    ([{"q": "x", "a": "{"}], {"checker": "math"}, r"cannot be scored by --task.checker=math"),
    ([{"q": "x", "a": 1}], {"solution_field": "w"}, r"field 'w': must be a non-empty string"),
  ],
)
def test_bad_rows_name_the_line_the_field_and_the_flag(tmp_path, rows, kw, message):
  kw = {"checker": "number", **kw}
  t = task(write(tmp_path / "d.jsonl", rows * 3), **kw)
  with pytest.raises(ValueError, match=message):
    t.num_problems("train")


def test_it_is_built_from_flags_alone_and_bad_flags_name_themselves(tmp_path):
  path = write(tmp_path / "d.jsonl", ROWS[2:] * 5)
  cfg = parse_flags(
    [
      "--task.name=jsonl",
      f"--task.data_path={path}",
      "--task.prompt_field=q",
      "--task.answer_field=a",
      "--task.checker=exact",
    ]
  )
  t = pieces.make_task(cfg.task, seed=0)
  p = t.problem("train", 0)
  assert p.answer == "Paris" and "Capital of France?" in p.prompt and "\\boxed{}" in p.prompt
  assert t.reward(None, ["\\boxed{Paris}"], [p.answer]) == [1.0]
  with pytest.raises(
    ConfigError, match=r"not accepted; choose one of \['number', 'math', 'exact'\]"
  ):
    parse_flags(["--task.name=jsonl", f"--task.data_path={path}", "--task.checker=string"])
  with pytest.raises(ConfigError, match=r"task.data_path.*jsonl reads your own JSON-lines file"):
    parse_flags(["--task.name=jsonl"])
  with pytest.raises(ConfigError, match=r"task.checker.*only for --task.name=jsonl"):
    parse_flags(["--task.checker=math"])
  # A bad row when the run loads its task: a FlagError naming --task.data_path.
  cfg = parse_flags(["--task.name=jsonl", f"--task.data_path={path}", "--task.prompt_field=x"])
  with pytest.raises(
    FlagError, match=r"--task.data_path: .*no field 'x' \(--task.prompt_field=x\)"
  ):
    pieces.load_task(cfg.task, seed=0, tok=None, encode=lambda text: [0])
