"""The task interface: get_task, its errors, and what every task provides."""

import dataclasses

import pytest

import jetrl.data
from jetrl.data import SPLITS, TASKS, Problem, Task, char_tokenizer, get_task, task_kwargs
from shared_data import GSM8K_DIR, MATH500_FILE, needs_shared


def test_names():
  assert set(TASKS) == {"addition", "multiplication", "sorting", "gsm8k", "math500"}
  assert SPLITS == ("train", "test")


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown task 'gsm9k'.*'addition'.*'math500'"):
    get_task("gsm9k")


@pytest.mark.parametrize("name, bad", [("addition", "lenght"), ("sorting", "path"),
                                       ("gsm8k", "difficulty"), ("math500", "order"),
                                       ("gsm8k", "timeout")])
def test_unknown_argument_lists_the_accepted_ones(name, bad):
  with pytest.raises(ValueError, match=f"unknown argument.*{bad}.*accepted.*seed"):
    get_task(name, **{bad: 1})


def test_accepted_arguments():
  for name in ("addition", "multiplication", "sorting"):
    assert set(task_kwargs(name)) == {"difficulty", "length", "seed", "format_weight"}
  common = {"path", "split", "seed", "test_size", "shuffle", "template", "tokenizer",
            "format_weight"}
  assert set(task_kwargs("gsm8k")) == common | {"order"}
  assert set(task_kwargs("math500")) == common | {"timeout", "batch_timeout", "symbolic"}


def test_problem_is_a_frozen_dataclass():
  p = Problem(prompt="1+1\n", answer="2", solution="answer: 2")
  assert [f.name for f in dataclasses.fields(Problem)] == ["prompt", "answer", "solution"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.answer = "3"


def all_tasks():
  tasks = [get_task(n, seed=1) for n in ("addition", "multiplication", "sorting")]
  if GSM8K_DIR.is_dir() and MATH500_FILE.is_file():
    tasks += [get_task("gsm8k", path=str(GSM8K_DIR), seed=1),
              get_task("math500", path=str(MATH500_FILE), seed=1)]
  return tasks


@pytest.mark.parametrize("task", all_tasks(), ids=lambda t: t.name)
def test_interface(task):
  assert isinstance(task, Task) and task.name in TASKS and task.seed == 1
  for split in SPLITS:
    problems = task.batch(split, 0, 8)
    assert all(isinstance(p, Problem) and p.prompt and p.answer for p in problems)
    assert problems == [task.problem(split, i) for i in range(8)]
    scores = task.reward([p.prompt for p in problems], [p.solution for p in problems],
                         [p.answer for p in problems])
    assert scores == [1.0] * 8
    scores = task.reward([p.prompt for p in problems], ["", None, "answer: x", "\\boxed{}",
                                                        "#### ", "}", "\n", "9" * 50],
                         [p.answer for p in problems])
    assert scores == [0.0] * 8
  assert isinstance(task.max_completion_chars, int) and task.max_completion_chars > 0
  with pytest.raises(ValueError):
    task.problem("validation", 0)
  with pytest.raises(ValueError):
    task.problem("train", -1)


def test_char_tokenizer_export():
  assert jetrl.data.char_tokenizer().vocab_size == char_tokenizer().vocab_size
  assert jetrl.data.CharTokenizer is type(char_tokenizer())


@needs_shared
def test_dataset_sizes_through_the_interface():
  assert get_task("gsm8k", path=str(GSM8K_DIR)).num_problems("test") == 1319
