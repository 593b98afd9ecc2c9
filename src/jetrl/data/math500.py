"""MATH-500 (competition math, the PRM800K subset of the MATH test set) as a task.

Source: the hub's `HuggingFaceH4/MATH-500` (one split, "test", 500 rows, columns `problem`,
`solution`, `answer`, `subject`, `level`, `unique_id`), or local JSON-lines files with at least
`problem` and `answer`. With one source split, 20% of it (100 rows) is held out as "test" and
the rest is "train" (see `jetrl.data.loading`); `split={"train": "test", "test": "test"}` uses
all 500 rows for both.

Problem.answer is the dataset's `answer`; Problem.solution its `solution` (ending in a
`\\boxed{}` answer), or '' without that column. The reward is `jetrl.data.rewards.math_reward`
(`timeout` seconds per sympy comparison, `batch_timeout` seconds of sympy time per call).
"""

from __future__ import annotations

import decimal
import math
from typing import Any, Sequence

from jetrl.data.answer_extraction import extract_boxed
from jetrl.data.loading import DatasetTask
from jetrl.data.math_normalize import normalize_latex
from jetrl.data.math_equivalence import DEFAULT_TIMEOUT
from jetrl.data.rewards import DEFAULT_BATCH_TIMEOUT, check_timeouts, math_reward


def answer_text(answer) -> str:
  """A row's answer as the reference string: a JSON number written out in plain digits
  (`1e20` -> `100000000000000000000`, never `1e+20`, which the reward would read as
  1*e + 20), exactly as the number it is; a string as it is."""
  if isinstance(answer, bool) or not isinstance(answer, (int, float)):
    return str(answer)
  if isinstance(answer, int):
    return str(answer)
  if answer.is_integer():
    return str(int(answer))
  return format(decimal.Decimal(repr(answer)), "f")


def boxed_answer(text) -> str | None:
  """A completion's last `\\boxed{}`, normalised (`normalize_latex`); None without one."""
  found = extract_boxed(text) if isinstance(text, str) else None
  return None if found is None else normalize_latex(found)


class Math500(DatasetTask):
  name = "math500"
  hub_name = "HuggingFaceH4/MATH-500"
  hub_config = None
  required_columns = ("problem", "answer")
  prompt_kind = "math"

  def __init__(
    self,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
    symbolic: bool = True,
    **kwargs,
  ):
    super().__init__(**kwargs)
    self.timeout, self.batch_timeout = check_timeouts(timeout, batch_timeout)
    self.symbolic = bool(symbolic)

  def row_errors(self, row: dict) -> list:
    """`problem` a non-empty string, `answer` a non-empty string or a number (never null: it
    would become the reference "None"), `solution` a string when present."""
    missing = [c for c in self.required_columns if c not in row]
    if missing:
      return [(None, f"the row lacks columns {missing} (it has {sorted(row)})")]
    problem, answer, solution = row["problem"], row["answer"], row.get("solution")
    if not isinstance(problem, str) or not problem.strip():
      return [("problem", f"must be a non-empty string, got {problem!r:.40}")]
    number = (
      isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer)
    )
    if not number and not (isinstance(answer, str) and answer.strip()):
      return [("answer", f"must be a non-empty string or a number, got {answer!r:.40}")]
    if solution is not None and not isinstance(solution, str):
      return [("solution", f"must be a string when present, got {type(solution).__name__}")]
    # The reward must be able to score the row: its answer, boxed, must score 1 against it.
    gold = self.row_answer(row)
    if math_reward(None, [f"\\boxed{{{gold}}}"], [gold], symbolic=False) != [1.0]:
      return [
        (
          "answer",
          f"{gold!r:.60} cannot be scored by the reward: \\boxed{{...}} of it does not "
          "score 1 against it (are its braces balanced?), so no completion could",
        )
      ]
    return []

  def row_question(self, row: dict) -> str:
    return row["problem"]

  def row_answer(self, row: dict) -> str:
    return answer_text(row["answer"])

  def row_solution(self, row: dict) -> str:
    return row.get("solution") or ""

  def extract_answer(self, text: str) -> str | None:
    """The last `\\boxed{}` the checker reads, normalised (`normalize_latex`)."""
    return boxed_answer(text)

  def reward(
    self, prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[str]
  ) -> list[float]:
    return math_reward(
      prompts,
      completions,
      answers,
      timeout=self.timeout,
      batch_timeout=self.batch_timeout,
      symbolic=self.symbolic,
      format_weight=self.format_weight,
    )
