"""Your own JSON-lines dataset as a task, from flags alone: `--task.name=jsonl`.

  python experiments/train.py --task.name=jsonl --task.data_path=my.jsonl \
      --task.prompt_field=question --task.answer_field=answer --task.checker=number ...

Each row is a JSON object; `prompt_field` holds the question (a non-empty string),
`answer_field` the reference answer (a non-empty string, or a JSON number), `solution_field`
(optional) a worked solution ending in that answer, which a supervised warm start trains on.
The file (or a directory of `*.jsonl` files, `train.jsonl` + `test.jsonl`) is read as the
built-in dataset tasks read theirs (`jetrl.data.loading`): one file is split 80/20 into train
and test by a fixed permutation, and every row is checked when the task loads, the first bad
one an error naming the file, the line, the field and the flag that names it.

`checker` says how a completion is scored against the answer:
  number: the final number (`#### 42`, `\\boxed{42}`, else the last number), compared as a
    number (`1,080` = `1080`); the prompt asks for `#### <number>` (GSM8K's scoring);
  math: the `\\boxed{}` answer, compared as MATH answers are (normalised, then by sympy:
    `\\frac{1}{2}` = `0.5`); the prompt asks for `\\boxed{}` (MATH-500's scoring);
  exact: the `\\boxed{}` answer, else what follows the last `####`, else the last non-empty
    line, equal to the answer as a string (surrounding spaces ignored); the prompt asks for
    `\\boxed{}`.
Every answer is checked against its checker when the task loads: its own boxed answer must
score 1, or the row is an error (a reference no completion could match).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from jetrl.data.answer_extraction import extract_boxed, gsm8k_answer
from jetrl.data.loading import DatasetTask
from jetrl.data.math500 import answer_text, boxed_answer
from jetrl.data.math_equivalence import DEFAULT_TIMEOUT
from jetrl.data.rewards import (
  DEFAULT_BATCH_TIMEOUT,
  check_timeouts,
  gsm8k_reference,
  gsm8k_reward,
  math_reward,
)
from jetrl.data.task import check_reward_args, completion_text

CHECKERS = ("number", "math", "exact")
# The flags that name a row's fields (for error messages).
FIELD_FLAGS = {
  "prompt_field": "--task.prompt_field",
  "answer_field": "--task.answer_field",
  "solution_field": "--task.solution_field",
}


def exact_answer(text: str) -> Optional[str]:
  """The answer a completion gives, for the exact checker: its last `\\boxed{}`, else what
  follows its last `####` (to the end of that line), else its last non-empty line."""
  boxed = extract_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if "####" in text:
    return text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  return lines[-1] if lines else None


def exact_reward(
  prompts: Optional[Sequence[str]],
  completions: Sequence[Any],
  answers: Sequence[Any],
  *,
  format_weight: float = 0.0,
) -> list[float]:
  """1.0 per completion whose answer (`exact_answer`) is the reference string (+ the format
  term: a `\\boxed{}` present)."""
  check_reward_args(prompts, completions, answers)
  out = []
  for completion, answer in zip(completions, answers):
    text = completion_text(completion)
    found = None if text is None else exact_answer(text)
    score = 1.0 if found is not None and found == str(answer).strip() else 0.0
    if format_weight and text is not None:
      score += format_weight * (extract_boxed(text) is not None)
    out.append(score)
  return out


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class JsonlTask(DatasetTask):
  """A JSON-lines file with fields of your naming, scored by a checker of your choosing."""

  name = "jsonl"

  def __init__(
    self,
    *,
    path=None,
    prompt_field: str = "question",
    answer_field: str = "answer",
    solution_field: Optional[str] = None,
    checker: str = "number",
    timeout: float = DEFAULT_TIMEOUT,
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
    **kwargs,
  ):
    if path is None:
      raise ValueError(
        "jsonl: needs a data file: pass --task.data_path=FILE.jsonl (or a directory of "
        "train.jsonl and test.jsonl)"
      )
    if checker not in CHECKERS:
      raise ValueError(f"jsonl: checker {checker!r} is not accepted; choose one of {CHECKERS}")
    for name, value in (("prompt_field", prompt_field), ("answer_field", answer_field)):
      if not isinstance(value, str) or not value:
        raise ValueError(f"jsonl: {FIELD_FLAGS[name]} must name a field, got {value!r}")
    super().__init__(path=path, **kwargs)
    self.prompt_field, self.answer_field = prompt_field, answer_field
    self.solution_field, self.checker_name = solution_field, checker
    self.timeout, self.batch_timeout = check_timeouts(timeout, batch_timeout)
    self.required_columns = (prompt_field, answer_field)
    self.prompt_kind = "gsm8k" if checker == "number" else "math"

  def row_errors(self, row: dict) -> list:
    """The prompt a non-empty string, the answer a non-empty string or a number that its
    checker can score, the solution (when named) a string."""
    for name in ("prompt_field", "answer_field"):
      key = getattr(self, name)
      if key not in row:
        return [
          (
            None,
            f"no field {key!r} ({FIELD_FLAGS[name]}={key}); the row's fields are "
            f"{sorted(row)}: name the right one with {FIELD_FLAGS[name]}",
          )
        ]
    prompt, answer = row[self.prompt_field], row[self.answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
      return [(self.prompt_field, f"must be a non-empty string, got {prompt!r:.40}")]
    if not _is_number(answer) and not (isinstance(answer, str) and answer.strip()):
      return [(self.answer_field, f"must be a non-empty string or a number, got {answer!r:.40}")]
    if self.solution_field is not None:
      solution = row.get(self.solution_field)
      if not isinstance(solution, str) or not solution.strip():
        return [
          (
            self.solution_field,
            f"must be a non-empty string ({FIELD_FLAGS['solution_field']}), got {solution!r:.40}",
          )
        ]
    gold = self.row_answer(row)
    if self.checker_name == "number" and gsm8k_reference(gold) is None:
      return [
        (
          self.answer_field,
          f"{answer!r:.60} is not a number (--task.checker=number); use --task.checker=math "
          "or exact for other answers",
        )
      ]
    boxed = [f"\\boxed{{{gold}}}"]
    if self.checker_name == "math":  # as MATH-500 checks its rows: without sympy
      score = math_reward(None, boxed, [gold], symbolic=False)
    else:
      score = self.reward(None, boxed, [gold])
    if score != [1.0]:
      return [
        (
          self.answer_field,
          f"{gold!r:.60} cannot be scored by --task.checker={self.checker_name}: "
          f"\\boxed{{...}} of it does not score 1 against it",
        )
      ]
    return []

  def row_question(self, row: dict) -> str:
    return row[self.prompt_field]

  def row_answer(self, row: dict) -> str:
    answer = answer_text(row[self.answer_field]).strip()
    if self.checker_name == "number":
      return gsm8k_reference(answer) or answer
    return answer

  def row_solution(self, row: dict) -> str:
    if self.solution_field is None:
      return ""
    return row.get(self.solution_field) or ""

  @property
  def max_completion_chars(self) -> Optional[int]:
    return None if self.solution_field is None else super().max_completion_chars

  def extract_answer(self, text: str) -> Optional[str]:
    """The answer its checker reads: "number", the final number, canonical; "math", the last
    `\\boxed{}`, normalised; "exact", `exact_answer`."""
    if not isinstance(text, str):
      return None
    if self.checker_name == "number":
      return gsm8k_answer(text)
    if self.checker_name == "math":
      return boxed_answer(text)
    return exact_answer(text)

  def reward(
    self, prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[str]
  ) -> list[float]:
    if self.checker_name == "number":
      return gsm8k_reward(prompts, completions, answers, format_weight=self.format_weight)
    if self.checker_name == "math":
      return math_reward(
        prompts,
        completions,
        answers,
        timeout=self.timeout,
        batch_timeout=self.batch_timeout,
        format_weight=self.format_weight,
      )
    return exact_reward(prompts, completions, answers, format_weight=self.format_weight)
