"""Synthetic tasks generated on the fly: the shared machinery.

Every synthetic task has two integer knobs:
  difficulty: how hard one scratchpad step is (more operands, more digits per operand);
  length: how many scratchpad steps there are, so the completion length grows with it.

Problems come from a `random.Random` seeded by (task, knobs, seed, split, index), so
`problem(split, index)` is deterministic. Train and test are disjoint by construction: a
problem belongs to the held-out test side when the SHA-256 of its prompt falls in 1/8 of the
hash range, and each split redraws until it gets a problem of its own side. This holds for every
seed, so no seed's train set contains another seed's test problems.

Completions are plain text over the character tokenizer's alphabet: a scratchpad, one line per
step, then a final line `answer: <answer>`. The reward is exact: 1.0 when the last non-blank
line of the completion is `answer: ` followed by exactly the reference answer (trailing
whitespace after it is ignored), else 0.0. The scratchpad itself is not checked.
"""

from __future__ import annotations

import abc
import hashlib
import random
from typing import Any, Sequence

from jetrl.data.task import (
  Problem,
  Task,
  check_index,
  check_reward_args,
  check_split,
  completion_text,
)

ANSWER_PREFIX = "answer: "
TEST_FRACTION_BITS = 3  # 1/8 of the problem space is held out for "test"
MAX_DRAWS = 10_000


def final_answer(text: Any) -> str | None:
  """The text after `answer: ` on the last non-blank line, or None if that line isn't one."""
  text = completion_text(text)
  if text is None:
    return None
  text = text.rstrip()
  last = text[text.rfind("\n") + 1 :]
  if not last.startswith(ANSWER_PREFIX):
    return None
  return last[len(ANSWER_PREFIX) :]


def misreport(problem: Problem, answer_chars: str) -> Problem:
  """The problem with its gold solution's final answer misreported: the answer's last character
  replaced by the next one of `answer_chars` (cyclically; '9' -> '0' for digits). The
  scratchpad and the reference answer are unchanged, so the reward still scores the true
  answer. Used for warm starts that solve a problem but report it unreliably
  (`SFTConfig.answer_noise`)."""
  head, sep, last = problem.solution.rstrip().rpartition("\n")
  if not last.startswith(ANSWER_PREFIX) or len(last) == len(ANSWER_PREFIX):
    raise ValueError(
      f"the gold solution does not end with {ANSWER_PREFIX!r}<answer>: {problem.solution[-40:]!r}"
    )
  c = last[-1]
  if c not in answer_chars:
    raise ValueError(f"answer character {c!r} is not one of {answer_chars!r}")
  swapped = answer_chars[(answer_chars.index(c) + 1) % len(answer_chars)]
  return Problem(problem.prompt, problem.answer, head + sep + last[:-1] + swapped)


def is_held_out(task_name: str, prompt: str) -> bool:
  """Whether a prompt lies on the held-out (test) side of the task's problem space."""
  digest = hashlib.sha256(f"{task_name}\n{prompt}".encode()).digest()
  return digest[0] >> (8 - TEST_FRACTION_BITS) == 0


def _check_knob(task: str, knob: str, value: Any, lo: int, hi: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise ValueError(f"{task}: {knob} must be an int in [{lo}, {hi}], got {value!r}")
  return value


class SyntheticTask(Task):
  """Base class: subclasses define the knobs' ranges, `_sample` and `_solve`."""

  name = ""
  difficulty_range = (1, 1)
  length_range = (1, 1)
  default_difficulty = 1
  default_length = 1
  answer_chars = "0123456789"  # characters a well-formed answer may contain

  def __init__(
    self,
    difficulty: int | None = None,
    length: int | None = None,
    seed: int = 0,
    format_weight: float = 0.0,
  ):
    self.difficulty = _check_knob(
      self.name,
      "difficulty",
      self.default_difficulty if difficulty is None else difficulty,
      *self.difficulty_range,
    )
    self.length = _check_knob(
      self.name, "length", self.default_length if length is None else length, *self.length_range
    )
    if isinstance(seed, bool) or not isinstance(seed, int):
      raise ValueError(f"seed must be an int, got {seed!r}")
    self.seed = seed
    self.format_weight = float(format_weight)

  # ---- subclass hooks ------------------------------------------------------------------

  @abc.abstractmethod
  def _sample(self, rng: random.Random) -> Any:
    """Random operands for one problem."""

  @abc.abstractmethod
  def _solve(self, operands: Any) -> tuple[str, str, str]:
    """(prompt, answer, gold completion) for the operands."""

  @abc.abstractmethod
  def _worst_case(self) -> Any:
    """Operands whose gold completion is the longest possible at these knobs."""

  # ---- Task ----------------------------------------------------------------------------

  def problem(self, split: str, index: int) -> Problem:
    check_split(split)
    index = check_index(index)
    want_test = split == "test"
    rng = random.Random(
      f"{self.name}|d{self.difficulty}|l{self.length}|s{self.seed}|{split}|{index}"
    )
    for _ in range(MAX_DRAWS):
      prompt, answer, solution = self._solve(self._sample(rng))
      if is_held_out(self.name, prompt) == want_test:
        return Problem(prompt, answer, solution)
    raise RuntimeError(f"{self.name}: no {split} problem found in {MAX_DRAWS} draws")

  def is_test_problem(self, problem: Problem) -> bool:
    return is_held_out(self.name, problem.prompt)

  def solve(self, operands: Any) -> Problem:
    """The problem for given operands (for tests and examples)."""
    return Problem(*self._solve(operands))

  @property
  def max_completion_chars(self) -> int:
    return len(self._solve(self._worst_case())[2])

  def well_formed(self, answer: str) -> bool:
    return bool(answer) and all(c in self.answer_chars for c in answer)

  def format_ok(self, completion: Any) -> bool:
    found = final_answer(completion)
    return found is not None and self.well_formed(found)

  def answer_of(self, completion: Any) -> str | None:
    """The answer a completion gives, in the form `expected` compares (None: no answer)."""
    return final_answer(completion)

  def extract_answer(self, text: str) -> str | None:
    """The answer `answer_of` reads (`final_answer`; canonical numbers for chat_arithmetic)."""
    return self.answer_of(text)

  def expected(self, answer: str) -> str:
    """The reference answer in the form `answer_of` gives."""
    return str(answer)

  def reward(
    self, prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[str]
  ) -> list[float]:
    check_reward_args(prompts, completions, answers)
    out = []
    for completion, answer in zip(completions, answers):
      found = self.answer_of(completion)
      score = 1.0 if found is not None and found == self.expected(answer) else 0.0
      if self.format_weight:
        score += self.format_weight * self.format_ok(completion)
      out.append(score)
    return out

  def __repr__(self) -> str:
    return (
      f"{type(self).__name__}(difficulty={self.difficulty}, length={self.length}, seed={self.seed})"
    )
