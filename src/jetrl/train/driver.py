"""What the RL loop (`jetrl.train.loop`) and the supervised warm start (`jetrl.train.sft`)
share around their steps.

A run builds its pieces (`jetrl.train.pieces.Pieces`: tokenizer, task, model config, device
layouts), restores
the newest intact checkpoint of its workdir or starts afresh (`restore_or_start`), opens its
files (`open_outputs`), wires the hooks every run has (`make_hooks`: the metric record and
console line, the skipped-updates stop, evaluation, checkpoints, plots), runs its steps with
the hooks after each (`run_steps`) and writes its summary (`finish`). What differs between the
two kinds of run is a `RunKind` (file names, checkpoint kind) and a `HookSpec` (what is
evaluated, saved and shown). `run_guarded` is what every run does around all of it: paths
checked, processes started, the workdir resolved (a link: its folder), locked and its tree
checked (no link in it: `run_files.check_tree`), the user's reward loaded and released.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional

import jax

from jetrl import parallel
from jetrl.kernels.code_memory import bound_code_mappings
from jetrl.train import pieces, resume
from jetrl.train.config import given_task_config
from jetrl.train.hooks import (
  CheckpointHook,
  EvalHook,
  Hook,
  LoopState,
  MetricsHook,
  PlotHook,
  SkipHook,
  run_hooks,
)
from jetrl.train.interrupt import Interrupts, RunInterrupted
from jetrl.train.run_files import resolve_workdir, write_atomic
from jetrl.train.skips import SkipTracker
from jetrl.train.workdir import LOCK_NAME, start_fresh, take_workdir
from jetrl.train.sinks import Sinks, TensorBoard, WandB, check_packages, open_sinks, workdir_files
from jetrl.train.writers import MetricWriter, Progress


@dataclasses.dataclass(frozen=True)
class RunKind:
  """How a kind of run names its files and its checkpoints."""

  kind: str  # "rl" / "sft": recorded in each checkpoint, checked on resume
  prefix: str  # of its files: <prefix>metrics.jsonl, <prefix>eval.jsonl, <prefix>summary.json
  metric_files: tuple[str, ...]  # records past a restored checkpoint's step are dropped
  run_files: tuple[str, ...]  # moved aside with the metric files by --overwrite


RL = RunKind(
  "rl",
  "",
  ("metrics.jsonl", "eval.jsonl", "samples.jsonl"),
  ("summary.json", "config.json", resume.CHANGES_FILE, "plots") + workdir_files(),
)
SFT = RunKind(
  "sft",
  "sft_",
  ("sft_metrics.jsonl", "sft_eval.jsonl"),
  ("sft_summary.json", "sft_config.json", resume.CHANGES_FILE, "plots") + workdir_files("sft_"),
)


def _silent(_line: str) -> None:
  pass


def _eval_tag(key: str) -> str:
  return "eval/" + key.removeprefix("eval_")


def tokenizer_and_task(cfg, given=None, reward=None):
  """(tokenizer, prompt encoder, task, prompt width) of `cfg`'s model and task nodes; the
  width is fixed from a sample of the task's prompts."""
  tok = pieces.make_tokenizer(cfg.model, cfg.task)
  pieces.token_ids(tok)  # a tokenizer without eos is an error before anything is built
  encode = pieces.prompt_encoder(cfg.task, tok)
  positions = None  # a checkpoint's positions bound its prompts; a preset's grow to fit
  if pieces.model_folder(cfg.model) is not None:
    positions = pieces.model_config(cfg.model, tok, 0).max_seq_len
  task, width = pieces.load_task(
    cfg.task,
    seed=cfg.seed,
    tok=tok,
    encode=encode,
    given=given,
    reward=reward,
    max_prompt_tokens=positions,
  )
  return tok, encode, task, width


def restore_or_start(cfg, kind: RunKind, ckpt, tree, log):
  """(tree, meta): from the newest intact checkpoint that passes `resume.resume_check` (a
  checkpoint of this kind of run, the same fields but the resumable ones, the same schedule;
  records written after its step dropped, a forced schedule change recorded), or (`tree`,
  None) after a fresh start (earlier files moved aside, never deleted)."""
  changes = []
  check = resume.resume_check(cfg, ckpt.directory, changes, kind=kind.kind)
  restored = ckpt.restore_latest(tree, check, log)
  if restored is None:
    parallel.on_primary(
      lambda: start_fresh(
        cfg.workdir,
        kind.metric_files,
        kind.run_files,
        first_checkpoint=min(cfg.checkpoint.every, cfg.steps),
        overwrite=cfg.overwrite,
        log=log,
        config_file=kind.prefix + "config.json",
        summary_file=kind.prefix + "summary.json",
      )
    )
    return tree, None
  tree, meta = restored
  start = int(meta["step"])
  say_length_change(start, (meta.get("config") or {}).get("steps"), cfg.steps, log)
  for name in kind.metric_files:
    writer = MetricWriter(cfg.workdir, name[: -len(".jsonl")], enabled=parallel.is_primary())
    writer.truncate_after(start)
  resume.record_changes(cfg.workdir, start, changes, log)
  return tree, meta


def say_length_change(start: int, saved_steps, steps: int, log) -> None:
  """A line when a resumed run's --steps differs from the run its checkpoint (of step `start`)
  was written by: a finished run extended, or a run's length changed."""
  if not isinstance(saved_steps, int) or saved_steps == steps:
    return
  if start >= saved_steps:
    log(f"extending a finished run from {saved_steps} to {steps} steps (--steps={steps})")
  else:
    log(
      f"changing the run's length from {saved_steps} to {steps} steps (--steps={steps}), "
      f"resuming at step {start}"
    )


@dataclasses.dataclass
class Outputs:
  """A run's files. Process 0 writes them; every process runs every step. `sinks`: where
  metric writers mirror their scalars (the logging backends that are on,
  `jetrl.train.sinks`), and the samples, the configuration and the plots go."""

  workdir: str
  kind: RunKind
  primary: bool
  opened: Optional[list] = None  # the sinks (`jetrl.train.sinks.open_sinks`)

  @property
  def sinks(self) -> Sinks:
    return Sinks(*(self.opened or ()))

  def _find(self, cls):
    return next((s for s in self.opened or () if isinstance(s, cls)), None)

  @property
  def tb(self) -> Optional[TensorBoard]:
    return self._find(TensorBoard)

  @property
  def wandb(self) -> Optional[WandB]:
    return self._find(WandB)

  def writer(self, name: str, *, tensorboard: bool = True, tag=None) -> MetricWriter:
    """The writer of `<workdir>/<prefix><name>.jsonl`, mirrored to the sinks if asked."""
    sinks = self.sinks
    return MetricWriter(
      self.workdir,
      self.kind.prefix + name,
      sinks if tensorboard and sinks else None,
      tag or (lambda key: key),
      enabled=self.primary,
    )

  def write_json(self, name: str, value: dict) -> None:
    if self.primary:
      write_atomic(os.path.join(self.workdir, self.kind.prefix + name), json.dumps(value, indent=1))

  def close(self) -> None:
    self.sinks.close()


def open_outputs(cfg, kind: RunKind, start: int = 0, log=None) -> Outputs:
  """The run's files, its configuration written as `<prefix>config.json` and given to the
  sinks; a run resumed after step `start` has TensorBoard purge what the run before it wrote
  past that step, and continues the workdir's W&B and MLflow runs. `log` gets one line per
  sink: where it writes and how to look."""
  primary = parallel.is_primary()
  out = Outputs(cfg.workdir, kind, primary, open_sinks(cfg, kind.prefix, start) if primary else [])
  out.write_json("config.json", cfg.to_dict())
  sinks = out.sinks
  if sinks:
    sinks.config(cfg.to_dict())
    for line in sinks.where() if log is not None else ():
      log(line)
  return out


@dataclasses.dataclass(frozen=True)
class HookSpec:
  """What one kind of run evaluates, saves and shows."""

  evaluate: Callable[[LoopState], dict]  # -> {"eval_accuracy", ...}
  console: Callable[[dict], tuple[dict, Optional[str]]]  # record -> console fields, extra
  skip_hint: str  # what to check when every update is skipped
  updates_per_step: int  # optimizer steps per step
  tree: Callable[[LoopState], Any]  # the checkpointed state
  meta: Callable[[LoopState], dict]  # checkpoint metadata besides step, kind and config
  draw: Callable[[str], list[str]]  # workdir -> the PNG plots drawn
  extra: tuple[Hook, ...] = ()  # run right after the metric record


@dataclasses.dataclass
class Hooks:
  all: list[Hook]
  evaluation: EvalHook  # the held-out evaluation (not text evaluation)
  plot: PlotHook
  checkpoint: Optional[CheckpointHook] = None  # also written when a run is interrupted


def user_hooks(hooks, entry: str) -> tuple[Hook, ...]:
  """The `hooks=` a caller of `run` / `run_sft` gives, checked before anything starts."""
  hooks = tuple(hooks)
  for h in hooks:
    if not isinstance(h, Hook):
      raise TypeError(
        f"{entry}: hooks must be jetrl.train.hooks.Hook instances (due(step, last) and "
        f"__call__(step, loop)), got {type(h).__name__}"
      )
  return hooks


def make_hooks(
  cfg, out: Outputs, ckpt, start: int, log, spec: HookSpec, user: tuple[Hook, ...] = ()
) -> Hooks:
  """The hooks, in the order they run after a step (`jetrl.train.hooks`): the record, the
  `extra` ones, the skipped-updates stop, evaluation, the checkpoint, the plots, then the
  caller's own (`user`: they see a step whose record and checkpoint are written)."""
  eval_hook = EvalHook(
    spec.evaluate,
    out.writer("eval", tag=_eval_tag),
    cfg.eval.every,
    cfg.eval.size,
    log,
    cfg.eval.label,
  )

  def draw() -> list[str]:
    paths = spec.draw(cfg.workdir)
    out.sinks.artifacts(paths)  # the PNGs, to the sinks that keep files
    return paths

  plot_hook = PlotHook(draw, cfg.logging.plot_every)

  def meta(step: int, loop: LoopState) -> dict:
    return {"step": step, **spec.meta(loop), "kind": out.kind.kind, "config": cfg.to_dict()}

  progress = Progress(cfg.steps, start, write=log if out.primary else _silent)
  ckpt_hook = CheckpointHook(ckpt, cfg.checkpoint.every, spec.tree, meta)
  hooks = [
    MetricsHook(out.writer("metrics"), progress, cfg.logging.every, spec.console),
    *spec.extra,
    SkipHook(SkipTracker(cfg.max_skipped_steps, spec.skip_hint), spec.updates_per_step),
    eval_hook,
    ckpt_hook,
  ] + ([plot_hook] if cfg.logging.plots and out.primary else [])
  return Hooks(hooks + list(user), eval_hook, plot_hook, ckpt_hook)


def run_steps(
  cfg,
  out: Outputs,
  hooks: Hooks,
  loop: LoopState,
  start: int,
  step: Callable[[int, LoopState], None],
  log: Callable[[str], None] = print,
) -> None:
  """`step(i, loop)` for i = start .. cfg.steps - 1, each followed by the hooks due after step
  i + 1; the hooks and the TensorBoard and W&B writers are closed however it ends.

  Ctrl-C (`jetrl.train.interrupt`, one process): the first lets the step finish and its hooks
  run, then the step's checkpoint is written (unless it just was) and `RunInterrupted` is
  raised once it is on disk; a second stops the process at once."""
  interrupts = Interrupts(log, enabled=jax.process_count() == 1)
  stopped = None
  try:
    with interrupts:
      for i in range(start, cfg.steps):
        interrupts.step = i + 1
        step(i, loop)
        last = i + 1 == cfg.steps
        run_hooks(hooks.all, i + 1, last, loop)
        if interrupts.requested:
          ckpt = hooks.checkpoint
          if ckpt is not None and not ckpt.due(i + 1, last):
            ckpt(i + 1, loop)
          stopped = i + 1
          break
  finally:
    for hook in hooks.all:
      hook.close()  # waits for the checkpoint to be on disk
    out.close()
  if stopped is not None:
    ckpt = hooks.checkpoint
    raise RunInterrupted(stopped, "" if ckpt is None else ckpt.checkpointer.directory)


def finish(out: Outputs, hooks: Hooks, summary: dict) -> dict:
  """`summary` with the plots' paths, written as `<prefix>summary.json`."""
  if hooks.plot.paths:
    summary["plots"] = hooks.plot.paths
  out.write_json("summary.json", summary)
  return summary


def run_guarded(cfg, task, log, body):
  """What a run (RL or SFT) does around its body: the config of a given Task object, paths
  checked, several processes started (the run's lines said by process 0 alone, the others'
  warnings and errors too: `parallel.primary_log`), the workdir locked, the user reward loaded; then
  `body(cfg, log, task, reward)`, and the reward worker and the lock released however it ends."""
  if task is not None:
    cfg = given_task_config(cfg, task)
  cfg.check_paths()
  check_packages(cfg.logging)  # a missing package is an error before anything is built
  parallel.maybe_initialize_distributed(log)  # several processes: before any JAX computation
  log = parallel.primary_log(log)  # the others say only their warnings and errors
  cfg = cfg.replace(workdir=resolve_workdir(cfg.workdir, log))  # a link: its folder, once
  new = not os.path.exists(cfg.workdir)
  lock = take_workdir(cfg.workdir, log)
  reward = None
  try:
    bound_code_mappings(log=log)  # runs one after another in one process (studies, sweeps)
    reward = pieces.load_user_reward(cfg.task, log)
    return body(cfg, log, task, reward)
  finally:
    if reward is not None:
      reward.close()
    if lock is not None:
      lock.release()
      if new:
        remove_if_only_lock(cfg.workdir)


def remove_if_only_lock(workdir: str) -> None:
  """Removes a workdir this run created when all it holds is the run's released lock file (a
  run that failed before writing anything), so a failed command leaves nothing behind."""
  try:
    if os.listdir(workdir) == [LOCK_NAME]:
      os.remove(os.path.join(workdir, LOCK_NAME))
      os.rmdir(workdir)
  except OSError:
    pass  # another run took it meanwhile, or it is not ours to remove
