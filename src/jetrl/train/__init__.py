"""The RL experiment runner: configs, loop, supervised warm start, checkpoints, writers, plots."""

from jetrl.train.config import (
  CheckpointConfig,
  EvalConfig,
  LoggingConfig,
  ModelSpec,
  SFTConfig,
  TaskConfig,
  TrainConfig,
)
from jetrl.train.hooks import Hook, LoopState
from jetrl.train.loop import run
from jetrl.train.sft import run_sft

__all__ = [
  "TrainConfig",
  "SFTConfig",
  "ModelSpec",
  "TaskConfig",
  "EvalConfig",
  "CheckpointConfig",
  "LoggingConfig",
  "Hook",
  "LoopState",
  "run",
  "run_sft",
]
