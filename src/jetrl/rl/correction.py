"""Importance-sampling corrections for a rollout/training policy mismatch.

When the rollout forward is not the training forward (e.g. an FP8 rollout of a BF16-trained
policy), tokens are sampled from pi_rollout while the loss assumes pi_train. Per token, the
importance ratio is

  rho_t = pi_train(y_t) / pi_rollout(y_t) = exp(train_logp_t - rollout_logp_t)

and a sequence's ratio is the product over its tokens, rho_seq = exp(sum_t log rho_t).
The methods (`IS_METHODS`), with cap C >= 1:

  "none"     w_t = 1
  "tis"      w_t = min(rho_t, C)                        truncated IS, per token
  "mis"      w_t = 1 if 1/C <= rho_t <= C else 0         masked IS: drop the token
  "seq_tis"  w_t = min(rho_seq, C), same for all tokens of the sequence
  "seq_mis"  w_t = 1 if 1/C <= rho_seq <= C else 0       drop the whole sequence

The sequence log-ratio is clamped to [-log_clamp, log_clamp] before exp, so a long sequence
cannot overflow (with the default log_clamp=20 this changes nothing for any cap < 4.8e8).

The weights are detached (stop_gradient): they multiply the per-token loss (see
`jetrl.rl.losses.ppo_clip_loss(is_weights=...)`) and carry no gradient. They are float32,
0 at masked-out positions. A NaN log-prob gives a NaN weight (never a silent drop).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jetrl.rl.masking import as_mask, masked, masked_mean

IS_METHODS = ("none", "tis", "mis", "seq_tis", "seq_mis")

_F32 = jnp.float32


def importance_weights(
  train_logp: chex.Array,
  rollout_logp: chex.Array,
  mask: chex.Array,
  *,
  method: str = "none",
  cap: float = 2.0,
  log_clamp: float = 20.0,
) -> tuple[chex.Array, dict[str, chex.Array]]:
  """Detached per-token importance weights correcting rollout/training mismatch.

  Args:
    train_logp: [B, T] log-probs of the sampled tokens under the training forward.
    rollout_logp: [B, T] log-probs of the same tokens as the rollout computed them.
    mask: [B, T] completion mask.
    method: one of `IS_METHODS` (see the module docstring).
    cap: C >= 1, the truncation cap (tis, seq_tis) or the accepted ratio range [1/C, C]
      (mis, seq_mis). Static.
    log_clamp: bound on |sum of token log-ratios| of a sequence before exp (seq methods).

  Returns:
    (weights, metrics): weights [B, T] float32 (0 at masked-out positions); metrics are
    float32 scalars, means over the masked tokens:
      frac_truncated: tokens whose weight was capped at C (tis, seq_tis),
      frac_dropped:   tokens given weight 0 (mis, seq_mis),
      mean_weight:    mean weight.
  """
  if method not in IS_METHODS:
    raise ValueError(
      f"unknown importance-sampling method {method!r}; accepted: {', '.join(IS_METHODS)}"
    )
  if not cap >= 1:
    raise ValueError(f"cap must be >= 1, got {cap!r}")
  if not log_clamp > 0:
    raise ValueError(f"log_clamp must be > 0, got {log_clamp!r}")
  chex.assert_rank([train_logp, rollout_logp, mask], 2)
  chex.assert_equal_shape([train_logp, rollout_logp, mask])
  chex.assert_type([train_logp, rollout_logp], float)

  m = as_mask(mask)
  train = masked(train_logp, m)
  rollout = masked(rollout_logp, m)
  log_ratio = jax.lax.stop_gradient(train - rollout)

  c = _F32(cap)
  inv_c = _F32(1.0 / cap)
  no = jnp.zeros(m.shape, bool)
  if method == "none":
    w = jnp.ones(m.shape, _F32)
    truncated, dropped = no, no
  else:
    if method in ("tis", "mis"):
      ratio = jnp.exp(log_ratio)
      bad = jnp.isnan(log_ratio)
    else:
      seq_log_ratio = jnp.sum(log_ratio, axis=1, keepdims=True)
      seq_log_ratio = jnp.clip(seq_log_ratio, -_F32(log_clamp), _F32(log_clamp))
      ratio = jnp.broadcast_to(jnp.exp(seq_log_ratio), m.shape)
      bad = jnp.broadcast_to(jnp.isnan(seq_log_ratio), m.shape)
    if method in ("tis", "seq_tis"):
      w = jnp.minimum(ratio, c)
      truncated, dropped = ratio > c, no
    else:
      keep = (ratio >= inv_c) & (ratio <= c)
      w = jnp.where(bad, jnp.nan, keep.astype(_F32))
      truncated, dropped = no, jnp.logical_not(keep) & jnp.logical_not(bad)
  w = jax.lax.stop_gradient(jnp.where(m, w, _F32(0.0)))
  metrics = {
    "frac_truncated": masked_mean(truncated, m),
    "frac_dropped": masked_mean(dropped, m),
    "mean_weight": masked_mean(w, m),
  }
  return w, metrics
