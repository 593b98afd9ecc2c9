"""Policy losses that treat the importance ratio otherwise than PPO's per-token clip.

  GSPO   the ratio of a whole sequence (its per-token log-ratios averaged), clipped per
         sequence (Qwen3's RL; Zheng et al., "Group Sequence Policy Optimization",
         arXiv 2507.18071);
  CISPO  the per-token ratio as a clipped, detached weight on a REINFORCE term, so that no
         token loses its gradient (MiniMax-M1; arXiv 2506.13585).

Both follow the conventions of `jetrl.rl.losses` (masked [B, T] arrays, float32, `(num, den)`
pairs that micro-batches add up exactly) and take the arguments of
`jetrl.rl.losses.ppo_clip_loss` (less `dual_clip`), so the update runs them from the loss table
(`jetrl.rl.objective.LOSS_SPECS`) like PPO: `is_weights` (the rollout/training mismatch
correction, detached) multiplies the per-token loss, `old_logp` is whichever old policy the
update chose. The metrics include those of `jetrl.rl.losses.ratio_metrics`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jetrl.rl.losses import (
  aggregate,
  check_clip_range,
  clipped_ratio_loss,
  policy_inputs,
  ratio_metrics,
)

_F32 = jnp.float32

# GSPO's clip range (arXiv 2507.18071, section 5.1: "the left and right clipping ranges ... to
# 3e-4 and 4e-4"): a sequence ratio is a geometric mean over tokens, so it stays far closer to
# 1 than a token's ratio does.
GSPO_CLIP = (3e-4, 4e-4)
# CISPO's: no lower bound on the weight (1 - 1.0 = 0; the paper sets eps_low "to a large
# value"), and an upper bound the paper tunes without stating it: 0.28, DAPO's clip-higher, the
# value other CISPO implementations (Trinity-RFT) default to.
CISPO_CLIP = (1.0, 0.28)


def gspo_loss(
  logp: chex.Array,
  old_logp: chex.Array,
  advantages: chex.Array,
  mask: chex.Array,
  *,
  clip_low: float = GSPO_CLIP[0],
  clip_high: float = GSPO_CLIP[1],
  aggregation: str = "seq_mean_token_mean",
  max_tokens: int | None = None,
  is_weights: chex.Array | None = None,
) -> tuple[chex.Array, chex.Array, dict[str, chex.Array]]:
  """GSPO: the PPO surrogate on a length-normalised sequence ratio (arXiv 2507.18071).

  With n_i = |y_i| the completion's token count,

    s_i = exp((1 / n_i) * sum_t (logp[i, t] - old_logp[i, t]))
    l_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)

  and the loss (aggregation "seq_mean_token_mean", the default) is the mean of l_i over the
  sequences with tokens: the paper's objective, clipped per sequence. It is computed in the
  paper's GSPO-token form, one term per token,

    s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))      (value s_i, d s_it / d logp_it = s_i)
    l_it = -w_it * min(s_it * A_it, clip(s_it, ...) * A_it)

  (sg: stop-gradient; w: `is_weights`, 1 without), whose token mean over a sequence is l_i
  with gradient d l_i / d logp_it = -s_i A_i / n_i where the clip does not bind, 0 where it
  does: GSPO's, exactly, for per-sequence advantages and no weights. Per-token advantages
  [B, T] or weights give GSPO-token (a dropped token, weight 0, loses its own gradient term;
  its log-ratio still counts in s_i). The other aggregations weigh the sequences otherwise
  ("token": by their lengths).

  Args, returns: as `jetrl.rl.losses.ppo_clip_loss` (its metrics, with the sequence ratio s_i
  as every token's ratio: a clip binds for all tokens of a sequence; dual_clip_frac is 0).
  """
  check_clip_range(clip_low, clip_high, aggregation)
  m, new, old, adv, w = policy_inputs(logp, old_logp, advantages, mask, is_weights)
  n = jnp.sum(m, axis=1, keepdims=True, dtype=_F32)
  seq_ratio = jnp.exp(jnp.sum(new - old, axis=1, keepdims=True) / jnp.maximum(n, 1.0))
  ratio = jax.lax.stop_gradient(seq_ratio) * jnp.exp(new - jax.lax.stop_gradient(new))
  kw = dict(clip_low=clip_low, clip_high=clip_high, aggregation=aggregation)
  return clipped_ratio_loss(ratio, adv, m, w, max_tokens=max_tokens, **kw)


def cispo_loss(
  logp: chex.Array,
  old_logp: chex.Array,
  advantages: chex.Array,
  mask: chex.Array,
  *,
  clip_low: float = CISPO_CLIP[0],
  clip_high: float = CISPO_CLIP[1],
  aggregation: str = "token",
  max_tokens: int | None = None,
  is_weights: chex.Array | None = None,
) -> tuple[chex.Array, chex.Array, dict[str, chex.Array]]:
  """CISPO: REINFORCE weighted by the clipped, detached IS ratio (MiniMax-M1, arXiv 2506.13585).

  With r_t = exp(logp_t - old_logp_t), the per-token loss is

    l_t = -w_t * sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

  (sg: stop-gradient; w: `is_weights`, 1 without), aggregated by token mean (the default, the
  paper's 1 / sum_i |o_i|). Every token keeps its gradient, d l_t / d logp_t =
  -w_t * clip(r_t) * A_t (over the denominator): clipping bounds the weight instead of
  dropping the token as PPO's min does. clip_low may be 1 (a lower bound of 0: none, the
  paper's choice). The loss's value is a surrogate (it scales with log pi), not comparable with
  a PPO loss's; its gradient is the point.

  Args, returns: as `jetrl.rl.losses.ppo_clip_loss`, with clip_low <= 1 (metrics:
  `ratio_metrics`; clip_frac_low / clip_frac_high count the tokens whose weight the lower /
  upper bound changed, whatever the advantage's sign).
  """
  check_clip_range(clip_low, clip_high, aggregation, low_may_be_one=True)
  m, new, old, adv, w = policy_inputs(logp, old_logp, advantages, mask, is_weights)
  r = jax.lax.stop_gradient(jnp.exp(new - old))
  weight = jnp.clip(r, _F32(1.0 - clip_low), _F32(1.0 + clip_high))
  per_token = -weight * adv * new
  if w is not None:
    per_token = per_token * w
  num, den = aggregate(per_token, m, aggregation, max_tokens=max_tokens)
  return num, den, ratio_metrics(r, r < 1.0 - clip_low, r > 1.0 + clip_high, m)
