"""The RL experiment runner: config, loop, supervised warm start, checkpoints, writers, plots."""

from jetrl.train.config import TrainConfig
from jetrl.train.loop import run
from jetrl.train.sft import SFTConfig, run_sft

__all__ = ["TrainConfig", "run", "SFTConfig", "run_sft"]
