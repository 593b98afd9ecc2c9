"""Arithmetic questions in words, for instruction-tuned models ("chat_arithmetic").

A small chat model (SmolLM2-135M-Instruct) solves 0.5% of GSM8K, too few for RL on a CPU to
see a reward. This task asks the same kind of model a question it can answer part of the time:

  prompt      What is 47 + 38 - 12?
              Please reason step by step, and put your final answer within \\boxed{}.
  completion  47 + 38 = 85, 85 - 12 = 73. The answer is \\boxed{73}.

Knobs (the synthetic tasks' two): `difficulty` is the digits per operand (1..6), `length` the
number of operations (1..6, so `length + 1` operands); each operation is `+` or `-` at random,
`-` only where the running total stays >= 0, so no answer is negative. The prompt is the user's message of a chat prompt
(`--task.prompt_format=chat`) or, plain, the text itself.

The reward is exact on the final number: 1.0 when the completion's answer equals the sum, else
0.0. The answer is the number in the last `\\boxed{...}` when the completion writes a box (the
box must hold exactly one number in an accepted spelling, `jetrl.data.number_answer`; an
empty, cut-off or other box is no answer, whatever follows it), else the last number of the
completion (ASCII digits only). `format_weight` adds its weight for a boxed number.
"""

from __future__ import annotations

import random
from typing import Any

from jetrl.data.answer_extraction import boxed_number, has_box, last_number
from jetrl.data.number_answer import read_number
from jetrl.data.prompts import CHAT_INSTRUCTION
from jetrl.data.synthetic import SyntheticTask
from jetrl.data.task import completion_text


def _operand(rng: random.Random, digits: int) -> int:
  return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def final_number(completion: Any) -> str | None:
  """The completion's answer, canonical: the number in its last `\\boxed{}` when it has a box
  (None if that box is empty, cut off or holds several numbers), else its last number; None
  when it has neither (or is not text)."""
  text = completion_text(completion)
  if text is None:
    return None
  return boxed_number(text) if has_box(text) else last_number(text)


class ChatArithmetic(SyntheticTask):
  name = "chat_arithmetic"
  needs_tokenizer = True  # words and a chat instruction: a model's own tokenizer
  difficulty_range = (1, 6)  # digits per operand
  length_range = (1, 6)  # operations: length + 1 operands
  default_difficulty = 2
  default_length = 1
  answer_chars = "-0123456789"

  def _sample(self, rng):
    numbers = [_operand(rng, self.difficulty) for _ in range(self.length + 1)]
    ops, total = [], numbers[0]
    for n in numbers[1:]:  # `-` only where the running total stays >= 0
      ops.append(rng.choice("+-") if n <= total else "+")
      total += n if ops[-1] == "+" else -n
    return tuple(numbers), tuple(ops)

  def _worst_case(self):
    top = 10**self.difficulty - 1  # the longest answer: every operation adds
    return (top,) * (self.length + 1), ("+",) * self.length

  def _solve(self, operands):
    numbers, ops = operands
    expr, total, steps = str(numbers[0]), numbers[0], []
    for op, n in zip(ops, numbers[1:]):
      new = total + n if op == "+" else total - n
      steps.append(f"{total} {op} {n} = {new}")
      expr += f" {op} {n}"
      total = new
    answer = str(total)
    prompt = f"What is {expr}?\n{CHAT_INSTRUCTION}"
    solution = f"{', '.join(steps)}. The answer is \\boxed{{{answer}}}."
    return prompt, answer, solution

  def format_ok(self, completion: Any) -> bool:
    """Whether the completion boxes a number, as the instruction asks."""
    text = completion_text(completion)
    return text is not None and has_box(text) and boxed_number(text) is not None

  def answer_of(self, completion: Any) -> str | None:
    return final_number(completion)

  def expected(self, answer: str) -> str:
    return read_number(str(answer))
