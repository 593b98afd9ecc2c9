"""Saying when an RL step has nothing to learn from.

A group-relative advantage is 0 for a group whose rewards are all equal, so a step in which
every group's rewards are equal (all 0: the reward is never satisfied; all 1: the problems are
too easy) changes nothing through the policy term, and neither does a step whose gradient
norm is 0 (every token masked, say). Such a run goes on quietly with a flat reward curve.
`SignalHook` writes a warning line for each such step and, after `limit` of them in a row,
one message with what likely causes it, read from the step's record: the share of samples
that hit the generation budget (`truncated_frac`), the reward mean.
"""

from __future__ import annotations

from typing import Callable, Optional

from jetrl.rl import metrics as names
from jetrl.train.hooks import Hook, LoopState

LIMIT = 5  # steps in a row without a learning signal before the message with likely causes


def no_signal(record: dict) -> Optional[str]:
  """Why the step of `record` has no learning signal (a phrase), or None when it has one."""
  if record.get("flat_groups", 0.0) >= 1.0:
    return (
      f"every group's rewards are equal (reward mean {record['reward_mean']:.3g}), so every "
      "advantage is 0"
    )
  skipped = float(record.get(names.SKIPPED_UPDATES, 0.0))  # a skipped update's norm reads 0
  if float(record.get(names.GRAD_NORM, 1.0)) == 0.0 and skipped == 0:
    return "the gradient norm is 0"
  return None


def likely_causes(record: dict, max_new_tokens: int) -> list[str]:
  """What likely takes a run's learning signal away, read from its last step's record."""
  causes = []
  truncated = float(record.get("truncated_frac", 0.0))
  if truncated > 0:
    causes.append(
      f"the generation budget is too short: {truncated:.0%} of the last step's samples hit "
      f"--sampling.max_new_tokens={max_new_tokens} (raise it)"
    )
  reward = float(record["reward_mean"])
  if reward == 0:
    causes.append(
      "the reward is never satisfied (reward mean 0): check that the prompts ask for the "
      "answer format the task's reward parses (--task.prompt_format, --task.reward), or start "
      "from a supervised warm start (experiments/sft.py, then --init_from)"
    )
  elif record.get("flat_groups", 0.0) >= 1.0:
    causes.append(
      f"every sample of a prompt gets the same reward (reward mean {reward:.3g}): the problems "
      "may be too easy or too hard for the policy, or the reward constant; more samples per "
      "prompt (--sampling.n) make differing rewards likelier"
    )
  else:
    causes.append(
      "rewards differ but no token carries a gradient: --update.mask_truncated masks every "
      "truncated sample, --update.dynamic_sampling drops groups of equal rewards"
    )
  return causes


class SignalHook(Hook):
  """After each RL step: a warning line when it had no learning signal, and after `limit`
  such steps in a row one message with the likely causes (again after the next `limit`)."""

  every = 1

  def __init__(self, log: Callable[[str], None], max_new_tokens: int, limit: int = LIMIT):
    self.log, self.max_new_tokens, self.limit = log, max_new_tokens, limit
    self.run = 0

  def __call__(self, step: int, loop: LoopState) -> None:
    why = no_signal(loop.record)
    if why is None:
      self.run = 0
      return
    self.run += 1
    self.log(f"warning: step {step} has no learning signal: {why}")
    if self.run % self.limit == 0:
      causes = likely_causes(loop.record, self.max_new_tokens)
      self.log(
        f"warning: no learning signal for {self.run} steps in a row (steps "
        f"{step - self.run + 1}..{step}); the policy is not changing. Likely causes:\n"
        + "\n".join(f"  - {c}" for c in causes)
      )
