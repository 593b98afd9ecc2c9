"""Synthetic sorting with written comparisons ("sorting").

`length` numbers, each below 10**difficulty (duplicates allowed), sorted ascending by bubble
sort with every comparison written out. Pass p (p = 1 .. length-1) compares neighbours left to
right over the first length-p+1 positions; a line `a>b` means the pair is swapped, `a<b` or
`a=b` that it is kept. After each pass a line `= ...` shows the whole list. There is no early
exit, so the completion has exactly length*(length-1)/2 comparison lines and length-1 pass
lines:

  prompt      sort 52 7 31 9
  completion  52>7
              52>31
              52>9
              = 7 31 9 52
              7<31
              31>9
              = 7 9 31 52
              7<9
              = 7 9 31 52
              answer: 7 9 31 52
"""

from __future__ import annotations

from jetrl.data.synthetic import ANSWER_PREFIX, SyntheticTask


class Sorting(SyntheticTask):
  name = "sorting"
  difficulty_range = (1, 12)  # digits per number (values in [0, 10**difficulty))
  length_range = (2, 60)  # numbers in the list
  default_difficulty = 2
  default_length = 5
  answer_chars = "0123456789 "

  def _sample(self, rng):
    return tuple(rng.randrange(10**self.difficulty) for _ in range(self.length))

  def _worst_case(self):
    return (10**self.difficulty - 1,) * self.length

  def well_formed(self, answer: str) -> bool:
    parts = answer.split(" ")
    return all(p.isascii() and p.isdigit() for p in parts)

  def _solve(self, operands):
    items = list(operands)
    n = len(items)
    lines = []
    for p in range(1, n):
      for j in range(n - p):
        a, b = items[j], items[j + 1]
        lines.append(f"{a}{'>' if a > b else '<' if a < b else '='}{b}")
        if a > b:
          items[j], items[j + 1] = b, a
      lines.append("= " + " ".join(map(str, items)))
    answer = " ".join(map(str, sorted(operands)))
    lines.append(ANSWER_PREFIX + answer)
    return "sort " + " ".join(map(str, operands)) + "\n", answer, "\n".join(lines)
