"""GSM8K (grade-school math word problems) as a task.

Source: the hub's `openai/gsm8k` ("main" config: train 7473 / test 1319 rows, columns
`question`, `answer`), or local JSON-lines files with the same columns. A row's `answer` is a
worked solution whose last line is `#### <number>`.

Problem.answer is the final number in canonical form (`1,080` -> `1080`). Problem.solution is
the worked answer with the `<<48/2=24>>` calculator annotations removed, still ending in
`#### <number>`. The reward is `jetrl.data.rewards.gsm8k_reward`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from jetrl.data.answer_extraction import DEFAULT_GSM8K_ORDER, gsm8k_answer
from jetrl.data.loading import DatasetTask
from jetrl.data.number_answer import read_number
from jetrl.data.rewards import check_gsm8k_order, gsm8k_reward

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def strip_calculator_annotations(text: str) -> str:
  return _CALCULATOR.sub("", text)


class GSM8K(DatasetTask):
  name = "gsm8k"
  hub_name = "openai/gsm8k"
  hub_config = "main"
  required_columns = ("question", "answer")
  prompt_kind = "gsm8k"

  def __init__(self, *, order: Sequence[str] = DEFAULT_GSM8K_ORDER, **kwargs):
    super().__init__(**kwargs)
    self.order = check_gsm8k_order(order)

  def row_errors(self, row: dict) -> list:
    """The required fields non-empty strings, and the answer ending in `#### <final>`."""
    errors = super().row_errors(row)
    if errors:
      return errors
    parts = row["answer"].rsplit("####", 1)
    if len(parts) < 2 or not parts[1].strip():
      return [("answer", "must end in '#### <final answer>'")]
    # The reward must be able to score the row: its own gold solution must score 1.
    final = self.row_answer(row)
    if gsm8k_reward(None, [self.row_solution(row)], [final], order=self.order) != [1.0]:
      return [
        (
          "answer",
          f"its final answer {parts[1].strip()!r:.60} is not a number the reward can read "
          "(a plain number, with commas only between groups of three digits): its own "
          "gold solution would score 0",
        )
      ]
    return []

  def row_question(self, row: dict) -> str:
    return row["question"]

  def row_answer(self, row: dict) -> str:
    final = row["answer"].rsplit("####", 1)[-1].strip()
    return read_number(final) or final

  def row_solution(self, row: dict) -> str:
    return strip_calculator_annotations(row["answer"]).strip()

  def extract_answer(self, text: str) -> str | None:
    """The final number the checker reads (`gsm8k_answer` in this task's order), canonical
    (`jetrl.data.number_answer`)."""
    return gsm8k_answer(text, self.order)

  def reward(
    self, prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[str]
  ) -> list[float]:
    return gsm8k_reward(
      prompts, completions, answers, order=self.order, format_weight=self.format_weight
    )
