"""The jitted rollout sampler."""

from jetrl.sampling.categorical import sample_categorical
from jetrl.sampling.config import TEMPERATURE_RANGE, GenerationConfig, SamplingConfig
from jetrl.sampling.sampler import (
  STOP_LENGTH,
  STOP_TOKEN,
  Rollout,
  pad_prompts,
  sample,
)

__all__ = [
  "STOP_LENGTH",
  "STOP_TOKEN",
  "Rollout",
  "GenerationConfig",
  "SamplingConfig",
  "TEMPERATURE_RANGE",
  "pad_prompts",
  "sample",
  "sample_categorical",
]
