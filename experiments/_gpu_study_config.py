"""experiments/gpu_study.py's configuration: the study's fields with the GPU design's
defaults and the script's own (the output directory, the workers, the deadlines, the length),
the warm start trained in chunks, and the flags the script took before the configuration's."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jetrl.config import ConfigError, field, node
from jetrl.rl import OptimizerConfig
from jetrl.train import ModelSpec, TaskConfig
from jetrl.study import StudyConfig, WarmStartConfig, set_by_study

# StudyConfig's fields that this script sets itself (from --out, --length / --min_tokens,
# --start_by_s), and the warm start's mix (the study has one length).
EXCLUDE = set_by_study(StudyConfig()) + (
  "report_dir",
  "lengths",
  "time_budget_s",
  "quiet_runs",
  "sft.mix",
)
# The flags of this script before it took the configuration's.
RENAMED = {
  "toy": "config=experiments/configs/gpu_study_toy.py",
  "n_layers": "model.n_layers",
  "group_size": "sampling.n",
  "temperature": "sampling.temperature (and --eval.temperature)",
  "lr": "optimizer.lr",
  "warmup_steps": "optimizer.warmup_steps",
  "eval_size": "eval.size (and --eval.batch)",
  "eval_samples": "eval.samples",
  "sft_lr": "sft.optimizer.lr",
  "answer_noise": "sft.answer_noise",
  "sft_batch": "sft.batch_size",
  "sft_chunk": "sft.steps",
  "sft_max_steps": "sft.max_steps",
  "sft_target": "sft.target",
  "sft_budget_s": "sft.budget_s",
}


@dataclasses.dataclass(frozen=True)
class ChunkedWarmStart(WarmStartConfig):
  """The study's warm start, trained in chunks until it reaches a target accuracy."""

  steps: int = field(100, "SFT steps per chunk; each chunk ends with an evaluation.", lo=1)
  length: Optional[int] = field(
    None, "Task length of the warm start (none: the runs' length, --length).", lo=0
  )
  optimizer: OptimizerConfig = node(
    OptimizerConfig(lr=1e-3, warmup_steps=20),
    "The warm start's optimizer; its schedule must be constant (the chunks extend one run).",
  )
  target: float = field(0.3, "Stop the warm start once its accuracy reaches this.", lo=0.0, hi=1.0)
  max_steps: int = field(3000, "Stop the warm start after this many steps.", lo=1)
  budget_s: float = field(
    150.0, "Start no warm-start chunk after this many seconds from the script's start.", lo=0.0
  )

  def __post_init__(self):
    super().__post_init__()
    if self.optimizer.schedule != "constant":
      raise ConfigError(
        "optimizer.schedule",
        f"{self.optimizer.schedule!r}: the warm start grows in chunks of --sft.steps, so its "
        "schedule must not depend on its length; use constant",
      )


@dataclasses.dataclass(frozen=True)
class GPUStudyConfig(StudyConfig):
  """The study's configuration with the GPU design's defaults, and this script's fields."""

  recipes: tuple[str, ...] = field(
    ("bf16", "fp8_rollout", "jet"),
    "Precision recipes: one arm each (and fp8_rollout+tis: --corrected, --correction).",
  )
  steps: int = field(24, "RL steps per run.", lo=1)
  model: ModelSpec = node(ModelSpec(n_layers=4), "The policy model.")
  task: TaskConfig = node(
    TaskConfig(difficulty=1), "A synthetic task (its length: --length, or from --min_tokens)."
  )
  sft: ChunkedWarmStart = node(ChunkedWarmStart, "The warm start shared by every run.")
  out: Optional[str] = field(
    None, "Output directory: gpu_study.json, the logs, study/ (the runs, the report); required."
  )
  workers: int = field(
    4, "Worker processes, each running whole recipes (1: every run in this process).", lo=1
  )
  start_by_s: float = field(
    400.0, "Start no run after this many seconds from the script's start.", lo=0.0
  )
  end_by_s: float = field(
    480.0,
    "Stop a run at its next step after this many seconds from the script's start (recorded "
    "as cut short; a rerun resumes it).",
    lo=0.0,
  )
  min_tokens: int = field(
    1024, "Smallest generation budget: sets the task length when --length is none.", lo=1
  )
  length: Optional[int] = field(
    None, "Task length knob (none: the smallest whose budget reaches --min_tokens).", lo=0
  )

  def __post_init__(self):
    super().__post_init__()
    if self.length is not None:
      self.task.check_lengths("length", [self.length])
    if self.end_by_s < self.start_by_s:
      raise ConfigError(
        "end_by_s", f"must be >= --start_by_s ({self.start_by_s:g}), got {self.end_by_s:g}"
      )
    if self.sft.budget_s > self.start_by_s:
      raise ConfigError(
        "sft.budget_s",
        f"must be <= --start_by_s ({self.start_by_s:g}): the warm start comes before the runs, "
        f"got {self.sft.budget_s:g}",
      )


def study_config(cfg: GPUStudyConfig) -> StudyConfig:
  """The library's StudyConfig of `cfg` (its fields, without this script's)."""

  def fields_of(cls, value):
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}

  return StudyConfig(
    **dict(fields_of(StudyConfig, cfg), sft=WarmStartConfig(**fields_of(WarmStartConfig, cfg.sft)))
  )


def task_length(cfg: StudyConfig, min_tokens: int) -> int:
  """The smallest task length whose generation budget reaches `min_tokens`."""
  from jetrl.data.registry import task_class  # pylint: disable=import-outside-toplevel
  from jetrl.study import max_new_tokens_for  # pylint: disable=import-outside-toplevel

  lo, hi = task_class(cfg.task.name).length_range
  for length in range(lo, hi + 1):
    if max_new_tokens_for(cfg, length) >= min_tokens:
      return length
  raise ConfigError(
    "min_tokens",
    f"{min_tokens}: no length of {cfg.task.name} (difficulty {cfg.task.difficulty}) reaches it; "
    f"its longest budget is {max_new_tokens_for(cfg, hi)} tokens (or set --length)",
  )
