"""How to sample (`--sampling.*`): the generation budget, the temperature and its range,
top-k / top-p, samples per prompt, and the ids the run fills in. Static under jit."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jetrl.config import ConfigError, check_fields, field

# The temperatures a sampler accepts besides 0 (greedy): --sampling.temperature=1e-30 once led
# to NaN params or every update skipped (docs/reliability.md).
TEMPERATURE_RANGE = (0.01, 100.0)


def temperature_field(default: float, help: str, **facts):
  """A temperature field: 0 (greedy) or in TEMPERATURE_RANGE."""
  lo, hi = TEMPERATURE_RANGE
  return field(default, help, lo=lo, hi=hi, also=(0.0,), **facts)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """The generation budget alone: the `sampling` node of a run that samples only to evaluate
  (SFT, `experiments/evaluate.py`), so that the budget is `--sampling.max_new_tokens` in
  every run."""

  max_new_tokens: int = field(
    128,
    "Generation budget: new tokens per sample (SFT: a longer gold solution is an error).",
    lo=1,
    former=("max_new_tokens",),
  )

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class SamplingConfig(GenerationConfig):
  """How to sample. Static under jit (frozen, hashable). The run's `sampling` config: its
  flags are `--sampling.<field>`; the run fills in the last three from the tokenizer and the
  task."""

  temperature: float = temperature_field(
    1.0,
    "Softmax temperature: 0 (greedy) or in [0.01, 100] (a smaller one overflows the logits' "
    "scale in bf16: NaN params or every update skipped, docs/reliability.md).",
    former=("temperature",),
  )
  top_k: Optional[int] = field(
    None,
    "Sample from the k most likely tokens only (none: all). In RL the rollout records each "
    "token's log-prob under the truncated, renormalised distribution and the update "
    "recomputes it under the same truncation of its own logits "
    '(docs/numerics.md, "Log-probs under top-k / top-p"): on-policy, bit for bit under '
    "jet_exact.",
    lo=1,
    legacy=((0, None),),  # before it was Optional, 0 meant all tokens
  )
  top_p: float = field(
    1.0,
    "Nucleus mass (1: all tokens). Recorded and recomputed under the same truncation as "
    "top_k: on-policy in RL, bit for bit under jet_exact.",
    lo=0.0,
    hi=1.0,
    lo_open=True,
  )
  n: int = field(
    1, "Samples per prompt (the GRPO group), sharing one prefill.", lo=1, former=("group_size",)
  )
  stop_ids: tuple[int, ...] = field(
    (), "Token ids that end a sample (kept, masked in).", flag=False
  )
  pad_id: int = field(0, "Filler for prompt padding and after a sample stopped.", flag=False)
  prompt_len: Optional[int] = field(
    None,
    "Static prompt width (None: the longest prompt rounded up to a multiple of 16).",
    lo=1,
    flag=False,
  )

  def __post_init__(self):
    if isinstance(self.stop_ids, (tuple, list)):
      object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
    k = self.top_k
    if isinstance(k, int) and not isinstance(k, bool) and k < 1:
      raise ConfigError(
        "top_k",
        f"must be a positive number of tokens, or none for no top-k (every token), got {k}",
      )
    check_fields(self)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0
