"""The task interface: get_task, its errors, and what every task provides."""

import dataclasses

import pytest

import jetrl.data
from jetrl.data import SPLITS, TASKS, Problem, Task, char_tokenizer, get_task, task_kwargs
from shared_data import GSM8K_DIR, MATH500_FILE, needs_shared


def test_names():
  assert set(TASKS) == {
    "addition",
    "multiplication",
    "sorting",
    "chat_arithmetic",
    "gsm8k",
    "math500",
    "jsonl",
  }
  assert SPLITS == ("train", "test")


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown task 'gsm9k'.*'addition'.*'math500'"):
    get_task("gsm9k")


@pytest.mark.parametrize(
  "name, bad",
  [
    ("addition", "lenght"),
    ("sorting", "path"),
    ("gsm8k", "difficulty"),
    ("math500", "order"),
    ("gsm8k", "timeout"),
  ],
)
def test_unknown_argument_lists_the_accepted_ones(name, bad):
  with pytest.raises(ValueError, match=f"unknown argument.*{bad}.*accepted.*seed"):
    get_task(name, **{bad: 1})


def test_accepted_arguments():
  for name in ("addition", "multiplication", "sorting", "chat_arithmetic"):
    assert set(task_kwargs(name)) == {"difficulty", "length", "seed", "format_weight"}
  common = {
    "path",
    "split",
    "seed",
    "test_size",
    "shuffle",
    "template",
    "tokenizer",
    "format_weight",
  }
  assert set(task_kwargs("gsm8k")) == common | {"order"}
  assert set(task_kwargs("math500")) == common | {"timeout", "batch_timeout", "symbolic"}


def test_problem_is_a_frozen_dataclass():
  p = Problem(prompt="1+1\n", answer="2", solution="answer: 2")
  assert [f.name for f in dataclasses.fields(Problem)] == ["prompt", "answer", "solution"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.answer = "3"


def all_tasks():
  tasks = [
    get_task(n, seed=1) for n in ("addition", "multiplication", "sorting", "chat_arithmetic")
  ]
  if GSM8K_DIR.is_dir() and MATH500_FILE.is_file():
    tasks += [
      get_task("gsm8k", path=str(GSM8K_DIR), seed=1),
      get_task("math500", path=str(MATH500_FILE), seed=1),
    ]
  return tasks


@pytest.mark.parametrize("task", all_tasks(), ids=lambda t: t.name)
def test_interface(task):
  assert isinstance(task, Task) and task.name in TASKS and task.seed == 1
  for split in SPLITS:
    problems = task.batch(split, 0, 8)
    assert all(isinstance(p, Problem) and p.prompt and p.answer for p in problems)
    assert problems == [task.problem(split, i) for i in range(8)]
    scores = task.reward(
      [p.prompt for p in problems], [p.solution for p in problems], [p.answer for p in problems]
    )
    assert scores == [1.0] * 8
    scores = task.reward(
      [p.prompt for p in problems],
      ["", None, "answer: x", "\\boxed{}", "#### ", "}", "\n", "9" * 50],
      [p.answer for p in problems],
    )
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


# ---------------------------------------------------------------------------- user tasks


class Echo(Task):
  """A user's task: repeat a word; the reward is whether the completion says it."""

  name = "echo"

  def __init__(self, word: str = "hello", seed: int = 0):
    self.word, self.seed = word, seed

  def problem(self, split, index):
    return Problem(
      prompt=f"Say {self.word} {index}.",
      answer=f"{self.word} {index}",
      solution=f"{self.word} {index}",
    )

  def reward(self, prompts, completions, answers):
    return [float(a in c) for c, a in zip(completions, answers)]


@pytest.fixture
def registry():
  from jetrl.data import registry as reg  # pylint: disable=import-outside-toplevel

  saved = dict(reg._USER)  # pylint: disable=protected-access
  yield reg
  reg._USER.clear()  # pylint: disable=protected-access
  reg._USER.update(saved)  # pylint: disable=protected-access


def test_register_a_task_object(registry):
  task = Echo("hi")
  assert jetrl.data.register_task(task) == "echo"
  assert get_task("echo") is task
  assert jetrl.data.task_names()[-1] == "echo" and "echo" not in TASKS
  assert task_kwargs("echo") == ()
  with pytest.raises(ValueError, match="registered as an object and takes no arguments"):
    get_task("echo", seed=3)
  with pytest.raises(ValueError, match="'echo' is already registered; pass replace=True"):
    jetrl.data.register_task(Echo())
  jetrl.data.register_task(Echo("yo"), replace=True)
  assert get_task("echo").problem("train", 2).prompt == "Say yo 2."
  jetrl.data.unregister_task("echo")
  with pytest.raises(ValueError, match="unknown task 'echo'"):
    get_task("echo")


def test_register_a_class_or_a_factory(registry):
  jetrl.data.register_task(Echo, name="echo_cls")
  assert set(task_kwargs("echo_cls")) == {"word", "seed"}
  assert get_task("echo_cls", word="yes").problem("test", 0).answer == "yes 0"
  with pytest.raises(ValueError, match="unknown argument.*'wrd'.*accepted.*'word'"):
    get_task("echo_cls", wrd="x")

  def make_echo(word="x"):
    return Echo(word)

  assert jetrl.data.register_task(make_echo) == "make_echo"
  assert get_task("make_echo", word="z").word == "z"
  jetrl.data.register_task(lambda: "not a task", name="broken")
  with pytest.raises(ValueError, match="factory returned a str, not a jetrl.data.Task"):
    get_task("broken")


@pytest.mark.parametrize(
  "task, name, match",
  [
    (Echo(), "gsm8k", "'gsm8k' is a built-in task"),
    (Echo(), "has space", "the name must be"),
    (3, None, "expected a jetrl.data.Task object"),
    (dict, None, "expected a jetrl.data.Task object"),
  ],
)
def test_register_errors(registry, task, name, match):
  with pytest.raises(ValueError, match=match):
    jetrl.data.register_task(task, name=name)


def test_with_reward_keeps_the_problems():
  base = get_task("addition", seed=4)
  task = jetrl.data.WithReward(base, lambda p, c, a: [len(x) / 10 for x in c], name="short")
  assert task.name == "short" and task.seed == 4
  assert task.problem("train", 5) == base.problem("train", 5)
  assert task.reward(None, ["abc", ""], ["1", "2"]) == [0.3, 0.0]
  assert task.max_completion_chars == base.max_completion_chars
  # Correctness stays the task's own: its checker is the base task, wrapped twice too.
  assert base.checker is base and task.checker is base
  assert jetrl.data.WithReward(task, lambda p, c, a: [0.0] * len(c)).checker is base
  bad = jetrl.data.WithReward(base, lambda p, c, a: [1.0])
  with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
    bad.reward(None, ["a", "b"], ["1", "2"])
