"""Measured gold completion lengths of the synthetic tasks, per knob setting.

  python -m jetrl.data.lengths            # the table in docs/tasks.md
  python -m jetrl.data.lengths --n 500    # more problems per setting

For each setting: mean, min and max length in characters of the gold completion over the
first n train problems (seed 0), the task's `max_completion_chars` bound, and the prompt length.
"""

from __future__ import annotations

import argparse
import statistics

from jetrl.data.registry import get_task

GRID = {  # task: (difficulty, lengths): the length knob at the default difficulty
  "addition": (1, (2, 3, 4, 8, 12, 16, 24, 32, 36, 40, 48, 64)),
  "multiplication": (3, (1, 2, 3, 5, 8, 12, 16, 20, 22, 24)),
  "sorting": (2, (2, 3, 4, 6, 8, 10, 12, 13, 14, 16)),
}
DIFFICULTY_GRID = {  # task: (difficulties, length): the difficulty knob at one length
  "addition": ((1, 2, 4, 9), 8),
  "multiplication": ((1, 2, 3, 5, 8), 4),
  "sorting": ((1, 2, 3, 5), 6),
}


def measure(name: str, difficulty: int, length: int, n: int = 200, seed: int = 0) -> dict:
  task = get_task(name, difficulty=difficulty, length=length, seed=seed)
  problems = task.batch("train", 0, n)
  sizes = [len(p.solution) for p in problems]
  return {
    "task": name,
    "difficulty": difficulty,
    "length": length,
    "mean": statistics.fmean(sizes),
    "min": min(sizes),
    "max": max(sizes),
    "bound": task.max_completion_chars,
    "prompt": statistics.fmean(len(p.prompt) for p in problems),
  }


def table(settings, n: int = 200) -> str:
  """A markdown table for (task, difficulty, length) settings."""
  lines = [
    "| task | difficulty | length | mean chars | min | max | max_completion_chars | prompt chars |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, difficulty, length in settings:
    r = measure(name, difficulty, length, n)
    lines.append(
      f"| {name} | {difficulty} | {length} | {r['mean']:.0f} | {r['min']} | "
      f"{r['max']} | {r['bound']} | {r['prompt']:.0f} |"
    )
  return "\n".join(lines)


def length_settings():
  return [(name, d, length) for name, (d, lengths) in GRID.items() for length in lengths]


def difficulty_settings():
  return [(name, d, length) for name, (ds, length) in DIFFICULTY_GRID.items() for d in ds]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=200, help="problems per setting")
  args = parser.parse_args(argv)
  print("Length knob (default difficulty):\n")
  print(table(length_settings(), args.n))
  print("\nDifficulty knob:\n")
  print(table(difficulty_settings(), args.n))


if __name__ == "__main__":
  main()
