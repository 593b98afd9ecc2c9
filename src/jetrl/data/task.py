"""The task interface the RL loop consumes: `Problem` and `Task`.

A task hands out problems by (split, index) and scores completions. Everything is
deterministic: the same task settings, seed, split and index always give the same problem, so
a run resumes by asking for the next index.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from typing import Any, Iterator, Sequence

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem.

  prompt: the text the policy continues.
  answer: the reference final answer that `Task.reward` compares against.
  solution: a gold completion (a worked solution ending with the final answer in the format
    the reward parses), for a supervised warm start; '' when the source has none.
  """

  prompt: str
  answer: str
  solution: str


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; accepted: {list(SPLITS)}")
  return split


def check_index(index: int) -> int:
  if isinstance(index, bool) or not isinstance(index, numbers.Integral) or index < 0:
    raise ValueError(f"index must be a non-negative int, got {index!r}")
  return int(index)


def completion_text(completion: Any) -> str | None:
  """The text of a completion: a str, or a TRL-style conversation (the last message's content).

  Returns None for anything else; rewards score that 0.
  """
  if isinstance(completion, str):
    return completion
  if isinstance(completion, dict):
    content = completion.get("content")
    return content if isinstance(content, str) else None
  if isinstance(completion, (list, tuple)) and completion:
    return completion_text(completion[-1])
  return None


def check_reward_args(prompts: Sequence, completions: Sequence, answers: Sequence) -> None:
  n = len(completions)
  if len(answers) != n or (prompts is not None and len(prompts) != n):
    raise ValueError(
      f"prompts, completions and answers must have the same length; got "
      f"{None if prompts is None else len(prompts)}, {n}, {len(answers)}"
    )


class Task(abc.ABC):
  """A source of problems with a verifiable reward.

  name: the registry name.
  problem(split, index): the problem at that position; deterministic in (seed, split, index).
  reward(prompts, completions, answers): one float per completion.
  checker: the task whose `reward` says whether a completion is correct (accuracy is the
    share of its values >= 1): the task itself, or, scored by another reward (`WithReward`),
    the wrapped task's checker.
  max_completion_chars: a hint for the longest gold completion at these settings (None when
    unknown).
  num_problems(split): the number of distinct problems (None: unbounded, generated).
  needs_tokenizer: whether its text needs a model's own tokenizer (natural language), so a
    preset model with only the character tokenizer is refused at start-up, naming the flag.
  extract_answer(text): optional; the answer a completion gives in a canonical form (equal
    answers, equal strings), None when it gives none: what maj@k votes on
    (`jetrl.train.pass_at_k`). A task without it reports pass@k alone (`answer_extractor`).
  """

  name: str = ""
  seed: int = 0
  needs_tokenizer: bool = False

  @abc.abstractmethod
  def problem(self, split: str, index: int) -> Problem: ...

  @abc.abstractmethod
  def reward(
    self, prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[str]
  ) -> list[float]: ...

  @property
  def checker(self) -> "Task":
    return self

  @property
  def max_completion_chars(self) -> int | None:
    return None

  def num_problems(self, split: str) -> int | None:
    check_split(split)
    return None

  def extract_answer(self, text: str) -> str | None:
    """The completion's answer, canonical (None: it gives none); optional, see the class
    docstring. The base task has none."""
    raise NotImplementedError(f"task {self.name!r} gives no extracted answers")

  def problems(self, split: str, start: int = 0, count: int | None = None) -> Iterator[Problem]:
    """Problems `start, start + 1, ...` of a split (`count` of them, or without end)."""
    check_split(split)
    i = check_index(start)
    while count is None or i < start + count:
      yield self.problem(split, i)
      i += 1

  def batch(self, split: str, start: int, size: int) -> list[Problem]:
    """Problems `start .. start + size - 1` of a split."""
    return list(self.problems(split, start, size))

  def __repr__(self) -> str:
    return f"{type(self).__name__}(name={self.name!r}, seed={self.seed})"


def answer_extractor(task: Task):
  """`extract_answer` of `task`'s checker (the task that says what is correct, so the vote is
  on the answers it judges), never raising (a failure is no answer); None when the checker
  has none."""
  checker = getattr(task, "checker", task)
  if type(checker).extract_answer is Task.extract_answer:
    return None

  def extract(text):
    try:
      found = checker.extract_answer(text)
    except Exception:  # a malformed completion gives no answer
      return None
    return None if found is None else str(found)

  return extract


class WithReward(Task):
  """`task`'s problems scored by another reward: `reward(prompts, completions, answers)` ->
  one float per completion (a TRL-shaped function, e.g. a `jetrl.data.UserReward`).

  Everything but the reward is the wrapped task's (problems, splits, seed, sizes), so a run
  over GSM8K's problems can be scored by the user's own function; whether a completion is
  correct is still the wrapped task's to say (`checker`), so accuracy means the same whatever
  reward trains the policy.
  """

  def __init__(self, task: Task, reward, *, name: str | None = None):
    if not isinstance(task, Task):
      raise ValueError(f"WithReward: expected a jetrl.data.Task, got {type(task).__name__}")
    if not callable(reward):
      raise ValueError(f"WithReward: the reward must be callable, got {type(reward).__name__}")
    self.task = task
    self.reward_fn = reward
    self.name = name or task.name
    self.seed = task.seed

  def problem(self, split: str, index: int) -> Problem:
    return self.task.problem(split, index)

  def reward(self, prompts, completions, answers) -> list[float]:
    check_reward_args(prompts, completions, answers)
    out = self.reward_fn(prompts, completions, answers)
    try:
      values = [float(v) for v in out]
    except (TypeError, ValueError) as e:
      raise ValueError(f"reward {self.reward_fn!r} did not return a list of floats: {e}") from None
    if len(values) != len(completions):
      raise ValueError(
        f"reward {self.reward_fn!r} returned {len(values)} values for "
        f"{len(completions)} completions"
      )
    return values

  @property
  def checker(self) -> Task:
    return self.task.checker

  @property
  def max_completion_chars(self) -> int | None:
    return self.task.max_completion_chars

  def num_problems(self, split: str) -> int | None:
    return self.task.num_problems(split)
