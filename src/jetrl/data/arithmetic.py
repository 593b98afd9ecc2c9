"""Synthetic arithmetic with a written scratchpad: multi-digit addition and multiplication.

Addition ("addition"): `difficulty + 1` addends of exactly `length` digits each. The scratchpad
adds one column per line, from the units up: the column's digits, plus the carry coming in,
equals the column sum, then the digits of the result found so far:

  prompt      4821+9374
  completion  1+4+0=5 5
              2+7+0=9 95
              8+3+0=11 195
              4+9+1=14 4195
              answer: 14195

Multiplication ("multiplication"): a `difficulty`-digit number times a `length`-digit number.
One line per partial product, from the multiplier's units digit up: the multiplicand times that
digit with its place-value zeros, equals the partial product, then the running total:

  prompt      123*45
  completion  123*5=615 615
              123*40=4920 5535
              answer: 5535
"""

from __future__ import annotations

import random

from jetrl.data.synthetic import ANSWER_PREFIX, SyntheticTask


def _digits(rng: random.Random, n: int) -> int:
  """A uniform random integer with exactly n digits."""
  return rng.randrange(10 ** (n - 1) if n > 1 else 1, 10**n)


class Addition(SyntheticTask):
  name = "addition"
  difficulty_range = (1, 9)  # number of addends - 1 (the carry stays one digit)
  length_range = (1, 300)  # digits per addend = scratchpad lines
  default_difficulty = 1
  default_length = 5

  def _sample(self, rng):
    return tuple(_digits(rng, self.length) for _ in range(self.difficulty + 1))

  def _worst_case(self):
    return (10**self.length - 1,) * (self.difficulty + 1)

  def _solve(self, operands):
    texts = [str(x) for x in operands]
    width = max(len(t) for t in texts)
    texts = [t.rjust(width, "0") for t in texts]
    lines, done, carry = [], "", 0
    for col in range(width - 1, -1, -1):
      digits = [t[col] for t in texts]
      total = sum(int(d) for d in digits) + carry
      done = str(total % 10) + done
      lines.append(f"{'+'.join(digits)}+{carry}={total} {done}")
      carry = total // 10
    answer = str(sum(operands))
    lines.append(ANSWER_PREFIX + answer)
    return "+".join(str(x) for x in operands) + "\n", answer, "\n".join(lines)


class Multiplication(SyntheticTask):
  name = "multiplication"
  difficulty_range = (1, 20)  # digits of the multiplicand
  length_range = (1, 60)  # digits of the multiplier = scratchpad lines
  default_difficulty = 3
  default_length = 3

  def _sample(self, rng):
    return _digits(rng, self.difficulty), _digits(rng, self.length)

  def _worst_case(self):
    return 10**self.difficulty - 1, 10**self.length - 1

  def _solve(self, operands):
    a, b = operands
    lines, total = [], 0
    for place, digit in enumerate(reversed(str(b))):
      part = a * int(digit) * 10**place
      total += part
      lines.append(f"{a}*{digit}{'0' * place}={part} {total}")
    answer = str(a * b)
    lines.append(ANSWER_PREFIX + answer)
    return f"{a}*{b}\n", answer, "\n".join(lines)
