"""An example reward function of your own, for `--task.reward=experiments/my_rewards.py:score`
(a path relative to where the command runs, or `module:fn`), or in Python
`load_reward("experiments/my_rewards.py:score")`.

A reward function takes the batch's prompts, completions and reference answers (strings,
one of each per completion) and returns one float per completion. It runs in a worker process
of its own (`jetrl.data.user_reward`): an exception, a NaN or a batch slower than
--task.reward_timeout scores the batch 0 with a warning, so keep it plain Python.

`score`: 1.0 when the completion's last number equals the answer (as a number: "1,080" and
"1080.0" are 1080), 0.2 when it gives the answer elsewhere but ends on another number, else 0;
minus 0.1 for a completion that rambles past 400 characters. Copy it and change the rules.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _value(text: str):
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def score(prompts, completions, answers) -> list[float]:
  del prompts  # this rule does not look at the question
  out = []
  for completion, answer in zip(completions, answers):
    if not isinstance(completion, str):  # chat messages: the assistant's last one
      completion = completion[-1]["content"]
    numbers = _NUMBER.findall(completion.replace(",", ""))
    gold = _value(str(answer))
    if numbers and gold is not None and _value(numbers[-1]) == gold:
      reward = 1.0
    elif any(_value(n) == gold for n in numbers):
      reward = 0.2
    else:
      reward = 0.0
    if len(completion) > 400:
      reward -= 0.1
    out.append(reward)
  return out
