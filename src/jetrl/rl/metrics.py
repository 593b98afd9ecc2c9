"""The names of the metrics an RL update writes, for the code that reads them.

Benchmarks, experiments and reports read these keys from the dict `update_step` returns (and
from the per-step records of a run's metrics.jsonl, which hold the same keys); naming them here
keeps a reader from asking for a key nothing writes. Read a metric with `read(metrics, NAME)`:
a missing key is an error naming it, never a silent default (a NaN column that looks measured).

Groups (what writes them):

  AGREEMENT_KEYS  `jetrl.rl.agreement.agreement_metrics`: rollout/training agreement of the
                  sampled tokens' log-probs (that module's docstring defines each one). The
                  update writes each under `AGREE_PREFIX` (`agree(ABS_DIFF_MEAN)` is
                  "agree/abs_diff_mean").
  UPDATE_KEYS     `jetrl.rl.update.summarize`, the float32 scalars of every update step.
  KL              written by the update only against a reference policy (kl_coef > 0).
  ROUTING_KEYS    a mixture of experts' routing agreement (`jetrl.rl.routing`), under
                  AGREE_PREFIX, written only when the batch carries the rollout's routes;
                  ROUTER_AUX_LOSS only with router_aux_coef > 0.

tests/test_metric_keys.py runs an update step and checks that every key listed here is in
its metrics, and that every metric name experiments/ reads is one of them.
"""

from __future__ import annotations

from typing import Any, Mapping

# --- rollout/training agreement (jetrl.rl.agreement.agreement_metrics) ----------------------

ABS_DIFF_MEAN = "abs_diff_mean"  # mean_t |Δ_t|, Δ = train - rollout log-prob (perfect: 0)
ABS_DIFF_MAX = "abs_diff_max"  # max_t |Δ_t| (perfect: 0)
KL_K3 = "kl_k3"  # k3 estimate of KL(rollout || train) (perfect: 0)
PROB_RATIO_ERROR = "prob_ratio_error"  # mean_t exp(|Δ_t|) (perfect: 1)
PROB_PEARSON = "prob_pearson"  # Pearson correlation of the token probabilities (perfect: 1)
RATIO_OUT_FRAC = "ratio_out_frac"  # share of tokens whose ratio is outside RATIO_BAND
SEQ_ABS_SUM_MEAN = "seq_abs_sum_mean"  # mean over rows of |sum_t Δ_t|
SEQ_ABS_SUM_MAX = "seq_abs_sum_max"  # max over rows of |sum_t Δ_t|
N_TOKENS = "n_tokens"  # masked tokens compared
BIN_ABS_DIFF_MEAN = "bin_abs_diff_mean"  # [n_bins] mean |Δ_t| per position bin
BIN_COUNT = "bin_count"  # [n_bins] masked tokens per position bin
ROW_ABS_DIFF_MEAN = "row_abs_diff_mean"  # [B] mean |Δ_t| of each row (not a step metric)

AGREEMENT_KEYS = (
  ABS_DIFF_MEAN,
  ABS_DIFF_MAX,
  KL_K3,
  PROB_RATIO_ERROR,
  PROB_PEARSON,
  RATIO_OUT_FRAC,
  SEQ_ABS_SUM_MEAN,
  SEQ_ABS_SUM_MAX,
  N_TOKENS,
  BIN_ABS_DIFF_MEAN,
  BIN_COUNT,
  ROW_ABS_DIFF_MEAN,
)

# A mixture of experts' routing agreement (jetrl.rl.routing), written only when the batch
# carries the rollout's routes (`make_train_batch(..., rollout_routes=)`).
ROUTE_AGREE = "route_agree"  # share of tokens with the same top-k experts in every layer (1)
ROUTE_AGREE_LAYER = "route_agree_layer"  # share of (token, layer) pairs with the same set (1)
ROUTE_RANK_SHIFT = "route_rank_shift"  # mean |rank in training - rank in the rollout| (0)
ROUTING_KEYS = (ROUTE_AGREE, ROUTE_AGREE_LAYER, ROUTE_RANK_SHIFT)

AGREE_PREFIX = "agree/"


def agree(key: str) -> str:
  """The update's key of an agreement metric: `agree("kl_k3")` is "agree/kl_k3"."""
  if key not in AGREEMENT_KEYS + ROUTING_KEYS:
    raise KeyError(
      f"{key!r} is not an agreement metric; those are {', '.join(AGREEMENT_KEYS + ROUTING_KEYS)}"
    )
  return AGREE_PREFIX + key


# --- the update step (jetrl.rl.update.summarize) ---------------------------------------------

LOSS = "loss"  # the loss, averaged over the applied (finite) optimizer steps
PG_LOSS = "pg_loss"  # its policy-gradient term
ENTROPY = "entropy"  # mean token entropy of the policy
GRAD_NORM = "grad_norm"  # global gradient norm, averaged over the applied steps
CLIP_FRAC_LOW = "clip_frac_low"  # token share clipped at 1 - eps_low
CLIP_FRAC_HIGH = "clip_frac_high"  # token share clipped at 1 + eps_high
RATIO_MEAN = "ratio_mean"  # token-weighted mean PPO ratio
SKIPPED_UPDATES = "skipped_updates"  # optimizer steps skipped for a non-finite gradient
OPTIMIZER_STEPS = "optimizer_steps"  # optimizer steps taken so far (the state's counter)
LEARNING_RATE = "learning_rate"  # the rate of the update's first optimizer step
IS_FRAC_TRUNCATED = "is_frac_truncated"  # tokens whose IS weight was capped (tis, seq_tis)
IS_FRAC_DROPPED = "is_frac_dropped"  # tokens given IS weight 0 (mis, seq_mis, icepop, geo_mis)
IS_FRAC_SEQ_DROPPED = "is_frac_seq_dropped"  # sequences with a token given IS weight 0
IS_MEAN_WEIGHT = "is_mean_weight"  # mean IS weight
KL = "kl"  # KL to the reference policy; only with kl_coef > 0
ROUTER_AUX_LOSS = "router_aux_loss"  # load-balancing loss; only with router_aux_coef > 0

AGREE_ABS_DIFF_MEAN = agree(ABS_DIFF_MEAN)  # the mismatch a benchmark reports
# Per row, [B]: the RL step moves it from the step's record to its completions table.
AGREE_ROW_ABS_DIFF_MEAN = agree(ROW_ABS_DIFF_MEAN)

UPDATE_KEYS = (
  LOSS,
  PG_LOSS,
  ENTROPY,
  GRAD_NORM,
  CLIP_FRAC_LOW,
  CLIP_FRAC_HIGH,
  RATIO_MEAN,
  SKIPPED_UPDATES,
  OPTIMIZER_STEPS,
  LEARNING_RATE,
  IS_FRAC_TRUNCATED,
  IS_FRAC_DROPPED,
  IS_FRAC_SEQ_DROPPED,
  IS_MEAN_WEIGHT,
) + tuple(AGREE_PREFIX + k for k in AGREEMENT_KEYS)


def read(metrics: Mapping[str, Any], key: str) -> Any:
  """metrics[key]; a missing key is a KeyError naming it and the keys there are."""
  try:
    return metrics[key]
  except KeyError:
    raise KeyError(
      f"metric {key!r} is not in these metrics (keys: {', '.join(sorted(metrics))})"
    ) from None
