"""The warning of an RL step without a learning signal, and the message after several in a
row, on hand-written step records."""

from __future__ import annotations

from jetrl.train.hooks import LoopState
from jetrl.train.learning_signal import SignalHook, no_signal


def record(flat=0.0, reward=0.5, grad_norm=0.3, truncated=0.0, skipped=0.0):
  return dict(
    flat_groups=flat,
    reward_mean=reward,
    grad_norm=grad_norm,
    truncated_frac=truncated,
    skipped_updates=skipped,
  )


def test_what_has_no_learning_signal():
  assert no_signal(record()) is None
  assert no_signal(record(flat=0.5)) is None  # half the groups still differ
  assert no_signal(record(flat=1.0, reward=0.0)) == (
    "every group's rewards are equal (reward mean 0), so every advantage is 0"
  )
  assert no_signal(record(grad_norm=0.0)) == "the gradient norm is 0"
  # Every update skipped reads a norm of 0: that is the skipped-updates stop's to report.
  assert no_signal(record(grad_norm=0.0, skipped=1.0)) is None


def test_a_warning_per_step_and_the_likely_causes_after_three_in_a_row():
  lines = []
  hook = SignalHook(lines.append, max_new_tokens=24, limit=3)
  steps = [record(), record(flat=1.0, reward=0.0, truncated=0.75)] + [
    record(flat=1.0, reward=0.0, truncated=0.25)
  ] * 2
  for step, r in enumerate(steps, 1):
    hook(step, LoopState(state=None, record=r))
  warn = "warning: step {} has no learning signal: every group's rewards are equal (reward "
  assert lines[:3] == [warn.format(k) + "mean 0), so every advantage is 0" for k in (2, 3, 4)]
  assert lines[3].splitlines() == [
    "warning: no learning signal for 3 steps in a row (steps 2..4); the policy is not "
    "changing. Likely causes:",
    "  - the generation budget is too short: 25% of the last step's samples hit "
    "--sampling.max_new_tokens=24 (raise it)",
    "  - the reward is never satisfied (reward mean 0): check that the prompts ask for the "
    "answer format the task's reward parses (--task.prompt_format, --task.reward), or start "
    "from a supervised warm start (experiments/sft.py, then --init_from)",
  ]
  # A step with a signal starts the count again.
  hook(5, LoopState(state=None, record=record()))
  for step in (6, 7):
    hook(step, LoopState(state=None, record=record(flat=1.0, reward=1.0)))
  assert len(lines) == 6
  hook(8, LoopState(state=None, record=record(flat=1.0, reward=1.0)))
  assert lines[-1].splitlines()[1:] == [
    "  - every sample of a prompt gets the same reward (reward mean 1): the problems may be "
    "too easy or too hard for the policy, or the reward constant; more samples per prompt "
    "(--sampling.n) make differing rewards likelier"
  ]
