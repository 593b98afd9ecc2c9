"""RL math for LLM policies: advantages, losses, importance-sampling corrections, agreement."""

from jetrl.rl.advantages import (
  ADVANTAGES,
  batch_normalize,
  compute_advantages,
  dynamic_sampling_mask,
  group_advantages,
  reinforce_pp_advantages,
  rloo_advantages,
)
from jetrl.rl.agreement import DEFAULT_EDGES, agreement_metrics, equal_width_edges, position_bins
from jetrl.rl.correction import IS_METHODS, importance_weights
from jetrl.rl.losses import (
  AGGREGATIONS,
  KL_ESTIMATORS,
  aggregate,
  entropy_bonus,
  finalize_loss,
  kl_penalty,
  overlong_penalty,
  ppo_clip_loss,
  truncation_mask,
)
from jetrl.rl.ratio_losses import cispo_loss, gspo_loss

__all__ = [
  "ADVANTAGES",
  "batch_normalize",
  "compute_advantages",
  "dynamic_sampling_mask",
  "group_advantages",
  "reinforce_pp_advantages",
  "rloo_advantages",
  "DEFAULT_EDGES",
  "agreement_metrics",
  "equal_width_edges",
  "position_bins",
  "IS_METHODS",
  "importance_weights",
  "AGGREGATIONS",
  "KL_ESTIMATORS",
  "aggregate",
  "entropy_bonus",
  "finalize_loss",
  "kl_penalty",
  "overlong_penalty",
  "ppo_clip_loss",
  "truncation_mask",
  "cispo_loss",
  "gspo_loss",
]

from jetrl.rl.batch import TrainBatch, make_train_batch, policy_logprobs  # noqa: E402
from jetrl.rl.objective import LOSS_SPECS, LOSSES, LossSpec  # noqa: E402
from jetrl.rl.optimizer import (  # noqa: E402
  SCHEDULES,
  OptimizerConfig,
  learning_rate_schedule,
  make_optimizer,
  skip_non_finite,
)
from jetrl.rl.update_config import OLD_LOGP_SOURCES, UpdateConfig  # noqa: E402
from jetrl.rl.state import TrainState, init_lora_train_state, init_train_state  # noqa: E402
from jetrl.rl.update import (  # noqa: E402
  check_batch_divisible,
  jit_update_step,
  update_step,
)

__all__ += [
  "TrainBatch",
  "make_train_batch",
  "policy_logprobs",
  "LOSS_SPECS",
  "LossSpec",
  "SCHEDULES",
  "OptimizerConfig",
  "learning_rate_schedule",
  "make_optimizer",
  "skip_non_finite",
  "LOSSES",
  "OLD_LOGP_SOURCES",
  "TrainState",
  "UpdateConfig",
  "check_batch_divisible",
  "init_lora_train_state",
  "init_train_state",
  "jit_update_step",
  "update_step",
]
