"""Stopping a run that no longer learns because every update is skipped.

The update skips an optimizer step whose loss, gradients or result is not finite, so NaN
never reaches the params. A run whose updates are all skipped, step after step, would still
finish with exit code 0 and report "done" (`--kl_coef=nan` once did). `SkipTracker` counts the
steps in a row in which every optimizer step was skipped and raises `SkippedUpdatesError`
when the count reaches the run's `--max_skipped_steps`; the entry points turn it into a
non-zero exit with its message. See docs/reliability.md.
"""

from __future__ import annotations


class SkippedUpdatesError(RuntimeError):
  """Every update of several steps in a row was skipped for non-finite values."""


class SkipTracker:
  """Counts consecutive steps whose updates were all skipped."""

  def __init__(self, limit: int, hint: str = ""):
    self.limit = limit
    self.hint = hint
    self.run = 0
    self.first = None

  def update(self, step: int, skipped: int, total: int) -> None:
    """After `step`: `skipped` of its `total` optimizer steps were skipped."""
    if total > 0 and skipped >= total:
      self.run += 1
      self.first = step if self.run == 1 else self.first
    else:
      self.run = 0
    if self.run >= self.limit:
      raise SkippedUpdatesError(
        f"stopped at step {step}: every update of the last {self.run} steps ({self.first}.."
        f"{step}) was skipped because the loss, the gradients or the updated params were "
        f"not finite; the params are still those from before step {self.first} and nothing "
        f"non-finite was saved. {self.hint}".strip()
      )
