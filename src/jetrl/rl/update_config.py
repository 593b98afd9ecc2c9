"""The update's configuration, `--update.*`: the loss (its defaults from the loss table,
`jetrl.rl.objective`), the mismatch correction, batching and the rewards' shaping. Static
under jit: a frozen dataclass that checks itself when built."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jetrl.config import ConfigError, check_fields, field
from jetrl.rl.correction import IS_METHODS, MASK_METHODS
from jetrl.rl.losses import AGGREGATIONS, KL_ESTIMATORS
from jetrl.rl.advantages import ADVANTAGES
from jetrl.rl.objective import ADVANTAGE_HELP, LOSS_HELP, LOSSES, LossFields
from jetrl.rl.remat import REMAT_POLICIES

OLD_LOGP_SOURCES = ("auto", "rollout", "recompute", "same_forward")
MASTER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class UpdateConfig(LossFields):
  """The policy-gradient update (static under jit): loss, correction, batching, rewards'
  shaping. Fields left None take the loss's default (`LossFields`)."""

  loss: str = field("grpo", LOSS_HELP, choices=LOSSES, former=("loss",))
  clip_low: Optional[float] = field(
    None,
    "Lower clip range of the ratio (none: the loss's default; < 1 but for cispo).",
    lo=0.0,
    hi=1.0,
    former=("clip_low",),
  )
  clip_high: Optional[float] = field(
    None,
    "Upper clip range of the ratio (none: the loss's default).",
    lo=0.0,
    hi=10.0,
    former=("clip_high",),
  )
  aggregation: Optional[str] = field(
    None, "How token losses are averaged (none: the loss's default).", choices=AGGREGATIONS
  )
  advantage: Optional[str] = field(None, ADVANTAGE_HELP, choices=ADVANTAGES)
  max_tokens: Optional[int] = field(
    None, "Dr.GRPO's constant normaliser in tokens per row (none: the generation budget).", lo=1
  )
  kl_coef: float = field(
    0.0,
    "Coefficient of the KL penalty to the initial policy.",
    lo=0.0,
    hi=100.0,
    former=("kl_coef",),
  )
  kl_estimator: str = field("k3", "KL estimator.", choices=KL_ESTIMATORS)
  entropy_coef: float = field(
    0.0, "Coefficient of the entropy bonus.", lo=0.0, hi=100.0, former=("entropy_coef",)
  )
  is_method: str = field(
    "none",
    "Rollout/training mismatch correction, a weight on each token from its ratio "
    'rho = pi_old / pi_rollout (docs/numerics.md, "Mismatch corrections"): tis min(rho, C); '
    "mis 1 inside [L, C], else 0; seq_tis / seq_mis the same on the sequence's product of "
    "ratios; icepop rho inside [L, C], else 0; geo_mis 1 while the sequence's geometric-mean "
    "ratio is inside [L, C], else 0 for the whole sequence.",
    choices=IS_METHODS,
    former=("is_correction",),
  )
  is_cap: float = field(
    2.0,
    "Cap C of the importance-sampling correction: the truncation (tis, seq_tis) or the upper "
    "end of the accepted band (mis, seq_mis, icepop, geo_mis; geo_mis wants one close to 1, "
    "e.g. 1.001).",
    lo=1.0,
    hi=1e6,
    former=("is_cap",),
  )
  is_cap_low: Optional[float] = field(
    None,
    "Lower end L of the band the masking corrections keep (mis, seq_mis, icepop, geo_mis; "
    "none: 1 / is_cap). IcePop's published band [0.5, 5]: is_cap=5, is_cap_low=0.5.",
    lo=0.0,
    hi=1.0,
    lo_open=True,
  )
  old_logp: str = field(
    "auto",
    "Source of the PPO ratio's old log-probs: the differentiated forward's own values "
    "(same_forward: the ratio is exactly 1, and no pre-update forward runs; one epoch of one "
    "minibatch only), a pre-update training forward (recompute), or the rollout's (rollout; "
    "no IS correction then). auto: same_forward for one epoch of one minibatch, else "
    "recompute.",
    choices=OLD_LOGP_SOURCES,
    former=("old_logp",),
  )
  ppo_epochs: int = field(1, "Passes over each rollout batch.", lo=1, former=("ppo_epochs",))
  minibatches: int = field(1, "Optimizer steps per pass.", lo=1, former=("minibatches",))
  micro_batches: int = field(
    1, "Gradient-accumulation micro-batches per minibatch.", lo=1, former=("micro_batches",)
  )
  master_dtype: str = field(
    "float32",
    "Dtype of the trained (master) weights.",
    choices=MASTER_DTYPES,
    former=("master_dtype",),
  )
  chunk_size: int = field(256, "Vocabulary chunk of the log-prob computation.", lo=1)
  remat: str = field(
    "auto",
    "Recompute each layer in the backward pass (auto: when the "
    "activations would not fit comfortably).",
    choices=REMAT_POLICIES,
  )
  dynamic_sampling: bool = field(
    False, "Mask out groups whose rewards are all equal (DAPO).", former=("dynamic_sampling",)
  )
  overlong_buffer: int = field(
    0, "DAPO soft overlong penalty buffer in tokens (0: off).", lo=0, former=("overlong_buffer",)
  )
  router_aux_coef: float = field(
    0.0,
    "Coefficient of a mixture of experts' load-balancing loss (transformers' "
    "router_aux_loss_coef form, over every layer and real position of each micro-batch; 0: "
    "off, as transformers leaves it without output_router_logits; a model's own "
    "router_aux_loss_coef is not applied unless given here).",
    lo=0.0,
    hi=100.0,
  )
  mask_truncated: bool = field(
    False, "Drop completions that hit the length limit from the loss.", former=("mask_truncated",)
  )

  def __post_init__(self):
    check_fields(self)
    self.check_loss()
    if self.old_logp == "rollout" and self.is_method != "none":
      raise ConfigError(
        "old_logp",
        f"'rollout' cannot be combined with is_method={self.is_method!r}: with the rollout's "
        "log-probs as the old policy the PPO ratio pi_theta/pi_rollout already carries the "
        "rollout/training mismatch, and the IS weight would apply it a second time; use "
        "old_logp='recompute' (the default) with the correction, or is_method='none'",
      )

    if self.is_cap_low is not None and self.is_method not in MASK_METHODS:
      raise ConfigError(
        "is_cap_low",
        f"is the lower end of the band of the masking corrections ({', '.join(MASK_METHODS)}); "
        f"is_method={self.is_method!r} has no band: leave it unset or pick one of those",
      )
    if self.old_logp == "same_forward" and (self.ppo_epochs != 1 or self.minibatches != 1):
      raise ConfigError(
        "old_logp",
        "'same_forward' takes the old policy from the forward being differentiated, which is "
        "the policy before the update only on the first optimizer step; it needs "
        f"ppo_epochs=1 and minibatches=1, got ppo_epochs={self.ppo_epochs}, "
        f"minibatches={self.minibatches} (use 'recompute' for several steps per batch)",
      )

  @property
  def resolved_old_logp(self) -> str:
    """The old log-probs' source `old_logp` names: 'auto' is same_forward for one epoch of
    one minibatch (the policy before the update is the one being differentiated), else
    recompute."""
    if self.old_logp != "auto":
      return self.old_logp
    one_step = self.ppo_epochs == 1 and self.minibatches == 1
    return "same_forward" if one_step else "recompute"

  def optimizer_steps(self, steps: int) -> int:
    """Optimizer steps of a run of `steps` RL steps (what its schedule runs over)."""
    return steps * self.ppo_epochs * self.minibatches
