"""The periodic work of a run loop as hooks: metric records, the skipped-updates stop,
evaluation, checkpoints, plots.

A loop (RL: `jetrl.train.loop`, SFT: `jetrl.train.sft`, both through
`jetrl.train.driver.run_steps`) runs its steps and, after each, calls `run_hooks`: every hook
whose `due(step, last)` holds runs, in list order. A hook is due every
`every` steps and, with `at_end`, at the run's last step (`every=None`: only then). The order
is part of the contract: a step's record is written and its skipped-updates check made before
its evaluation and its checkpoint, so nothing non-finite is saved and a checkpoint never comes
before the records of its step (a resumed run drops records past its checkpoint and writes
them again).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

from jetrl.train.evaluation import at_k_line
from jetrl.train.progress import ticking
from jetrl.train.skips import SkipTracker
from jetrl.train.writers import MetricWriter, Progress


@dataclasses.dataclass
class LoopState:
  """What the hooks see of a run after a step."""

  state: Any  # the train state
  data_pos: int = 0  # problems consumed so far (the next batch starts here)
  record: dict = dataclasses.field(default_factory=dict)  # this step's metrics
  skipped: int = 0  # optimizer steps of this step skipped as non-finite
  samples: Optional[list] = None  # this step's sampled completions, when they are logged


class Hook:
  """Periodic work: `__call__(step, loop)` when `due(step, last)`."""

  every: Optional[int] = None
  at_end: bool = True

  def due(self, step: int, last: bool) -> bool:
    return (last and self.at_end) or (self.every is not None and step % self.every == 0)

  def __call__(self, step: int, loop: LoopState) -> None:
    raise NotImplementedError

  def close(self) -> None:
    pass


def run_hooks(hooks: Sequence[Hook], step: int, last: bool, loop: LoopState) -> None:
  for hook in hooks:
    if hook.due(step, last):
      hook(step, loop)


class MetricsHook(Hook):
  """Writes the step's record (JSON lines, TensorBoard) and the console line."""

  def __init__(
    self,
    writer: MetricWriter,
    progress: Progress,
    every: int,
    console: Callable[[dict], tuple[dict, Optional[str]]],
  ):
    self.writer, self.progress, self.every = writer, progress, every
    self.console = console  # record -> (fields, extra text) of the console line

  def __call__(self, step, loop):
    self.writer.write(step, loop.record)
    fields, extra = self.console(loop.record)
    self.progress.update(step, fields, extra)


class SamplesHook(Hook):
  """Appends the step's sampled completions (records with their own "step") to `writer`
  when the step produced them (`--logging.samples_every`), and gives them to `sinks` (a
  table in TensorBoard, W&B and MLflow: `jetrl.train.sinks.Sinks`) if given."""

  every = 1
  at_end = False

  def __init__(self, writer: MetricWriter, sinks=None):
    self.writer, self.sinks = writer, sinks

  def __call__(self, step, loop):
    if loop.samples:
      self.writer.write_many(loop.samples)
      if self.sinks and self.writer.enabled:
        self.sinks.samples(step, loop.samples)


class SkipHook(Hook):
  """Stops the run (SkippedUpdatesError) when every update of several steps in a row was
  skipped; runs at every step."""

  every = 1

  def __init__(self, tracker: SkipTracker, updates_per_step: int):
    self.tracker, self.updates_per_step = tracker, updates_per_step

  def __call__(self, step, loop):
    self.tracker.update(step, loop.skipped, self.updates_per_step)


PASS_KEY = "eval_pass_at_"  # eval_pass_at_K: pass@K of an evaluation with --eval.k


class EvalHook(Hook):
  """Greedy evaluation on held-out problems: `evaluate(loop) -> {"eval_accuracy", ...}`,
  written to `writer` and logged."""

  def __init__(
    self,
    evaluate: Callable[[LoopState], dict],
    writer: MetricWriter,
    every: Optional[int],
    size: int,
    log: Callable[[str], None],
    label: str = "greedy accuracy",
  ):
    self.evaluate, self.writer, self.every, self.size, self.log = evaluate, writer, every, size, log
    self.label = label
    self.last: Optional[dict] = None

  def __call__(self, step, loop):
    t0 = time.time()
    first = self.log if self.last is None else None  # the first evaluation compiles
    what = f"  eval @ step {step}: compiling the evaluation (first evaluation only)"
    with ticking(what, first, report=False):  # the line below says how long it took
      self.last = self.evaluate(loop)
    self.writer.write(step, self.last)
    bf16 = self.last.get("eval_accuracy_bf16")
    ks = sorted(
      int(key[len(PASS_KEY) :])
      for key in self.last
      if key.startswith(PASS_KEY) and key[len(PASS_KEY) :].isdigit()
    )
    at_k = at_k_line(self.last, ks)
    self.log(
      f"  eval @ step {step}: {self.label} {self.last['eval_accuracy']:.3f}"
      + ("" if bf16 is None else f" (bf16 rollout: {bf16:.3f})")
      + (f", {at_k}" if at_k else "")
      + f" on {self.size} held-out problems ({time.time() - t0:.1f}s)"
    )


class CheckpointHook(Hook):
  """Saves `tree(loop)` with `meta(step, loop)` every `every` steps and at the end."""

  def __init__(
    self,
    checkpointer,
    every: int,
    tree: Callable[[LoopState], Any],
    meta: Callable[[int, LoopState], dict],
  ):
    self.checkpointer, self.every, self.tree, self.meta = checkpointer, every, tree, meta

  def __call__(self, step, loop):
    self.checkpointer.save(step, self.tree(loop), self.meta(step, loop))

  def close(self):
    self.checkpointer.close()


class PlotHook(Hook):
  """Redraws the PNG plots every `every` steps (None: only at the end)."""

  def __init__(self, draw: Callable[[], list[str]], every: Optional[int]):
    self.draw, self.every = draw, every
    self.paths: list[str] = []

  def __call__(self, step, loop):
    self.paths = self.draw()
