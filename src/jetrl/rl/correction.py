"""Importance-sampling corrections for a rollout/training policy mismatch.

When the rollout forward is not the training forward (e.g. an FP8 rollout of a BF16-trained
policy), tokens are sampled from pi_rollout while the loss assumes pi_train. Per token, the
importance ratio is

  rho_t = pi_train(y_t) / pi_rollout(y_t) = exp(train_logp_t - rollout_logp_t)

a sequence's ratio is the product over its n tokens, rho_seq = exp(sum_t log rho_t), and its
geometric mean rho_geo = exp((1/n) sum_t log rho_t). The methods (`IS_METHODS`), with cap
C >= 1 and the accepted band [L, C] of the masking methods (L = `cap_low`, 1/C by default):

  "none"     w_t = 1
  "tis"      w_t = min(rho_t, C)                        truncated IS, per token
  "mis"      w_t = 1 if L <= rho_t <= C else 0          masked IS: drop the token
  "seq_tis"  w_t = min(rho_seq, C), same for all tokens of the sequence
  "seq_mis"  w_t = 1 if L <= rho_seq <= C else 0        drop the whole sequence
  "icepop"   w_t = rho_t if L <= rho_t <= C else 0      IcePop: the ratio inside the band,
                                                        0 outside (both sides)
  "geo_mis"  w_t = 1 if L <= rho_geo <= C else 0        geometric-mean sequence mask

The sequence log-ratios (sum or mean) are clamped to [-log_clamp, log_clamp] before exp, so a
long sequence cannot overflow (with the default log_clamp=20 this changes nothing for any
cap < 4.8e8).

The weights are detached (stop_gradient): they multiply the per-token loss (see
`jetrl.rl.losses.ppo_clip_loss(is_weights=...)`) and carry no gradient. They are float32,
0 at masked-out positions. A NaN log-prob gives a NaN weight (never a silent drop).
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from jetrl.rl.masking import as_mask, masked, masked_mean

IS_METHODS = ("none", "tis", "mis", "seq_tis", "seq_mis", "icepop", "geo_mis")
# The methods whose weight is 0 outside an accepted band [cap_low, cap] (the others truncate).
MASK_METHODS = ("mis", "seq_mis", "icepop", "geo_mis")
_SEQUENCE = {"seq_tis": "sum", "seq_mis": "sum", "geo_mis": "mean"}

_F32 = jnp.float32


def accepted_band(cap: float, cap_low: Optional[float] = None) -> tuple[float, float]:
  """(L, C): the ratio band the masking methods keep; L is 1/C unless `cap_low` is given."""
  if not cap >= 1:
    raise ValueError(f"cap must be >= 1, got {cap!r}")
  low = 1.0 / cap if cap_low is None else cap_low
  if not 0 < low <= 1:
    raise ValueError(f"cap_low must be in (0, 1] (a band that keeps ratio 1), got {cap_low!r}")
  return low, cap


def importance_weights(
  train_logp: chex.Array,
  rollout_logp: chex.Array,
  mask: chex.Array,
  *,
  method: str = "none",
  cap: float = 2.0,
  cap_low: Optional[float] = None,
  log_clamp: float = 20.0,
) -> tuple[chex.Array, dict[str, chex.Array]]:
  """Detached per-token importance weights correcting rollout/training mismatch.

  Args:
    train_logp: [B, T] log-probs of the sampled tokens under the training forward.
    rollout_logp: [B, T] log-probs of the same tokens as the rollout computed them.
    mask: [B, T] completion mask.
    method: one of `IS_METHODS` (see the module docstring).
    cap: C >= 1, the truncation cap (tis, seq_tis) or the upper end of the accepted ratio
      band (mis, seq_mis, icepop, geo_mis). Static.
    cap_low: the lower end L of the accepted band, in (0, 1] (None: 1/C). Static.
    log_clamp: bound on |a sequence's log-ratio| before exp (sequence methods).

  Returns:
    (weights, metrics): weights [B, T] float32 (0 at masked-out positions); metrics are
    float32 scalars:
      frac_truncated:   tokens whose weight was capped at C (tis, seq_tis),
      frac_dropped:     tokens given weight 0 by a mask (mis, seq_mis, icepop, geo_mis),
      frac_seq_dropped: sequences (rows with a completion token) with a dropped token,
      mean_weight:      mean weight.
    Token shares are over the masked tokens.
  """
  if method not in IS_METHODS:
    raise ValueError(
      f"unknown importance-sampling method {method!r}; accepted: {', '.join(IS_METHODS)}"
    )
  low, cap = accepted_band(cap, cap_low)
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
  no = jnp.zeros(m.shape, bool)
  if method == "none":
    w = jnp.ones(m.shape, _F32)
    truncated, dropped = no, no
  else:
    if method in _SEQUENCE:
      seq_log_ratio = jnp.sum(log_ratio, axis=1, keepdims=True)
      if _SEQUENCE[method] == "mean":
        n = jnp.maximum(jnp.sum(m, axis=1, keepdims=True, dtype=_F32), 1.0)
        seq_log_ratio = seq_log_ratio / n
      seq_log_ratio = jnp.clip(seq_log_ratio, -_F32(log_clamp), _F32(log_clamp))
      ratio = jnp.broadcast_to(jnp.exp(seq_log_ratio), m.shape)
      bad = jnp.broadcast_to(jnp.isnan(seq_log_ratio), m.shape)
    else:
      ratio = jnp.exp(log_ratio)
      bad = jnp.isnan(log_ratio)
    if method in MASK_METHODS:
      keep = (ratio >= _F32(low)) & (ratio <= c)
      inside = ratio if method == "icepop" else jnp.ones(m.shape, _F32)
      w = jnp.where(bad, jnp.nan, jnp.where(keep, inside, _F32(0.0)))
      truncated, dropped = no, jnp.logical_not(keep) & jnp.logical_not(bad)
    else:
      w = jnp.minimum(ratio, c)
      truncated, dropped = ratio > c, no
  w = jax.lax.stop_gradient(jnp.where(m, w, _F32(0.0)))
  rows = jnp.any(m, axis=1)
  metrics = {
    "frac_truncated": masked_mean(truncated, m),
    "frac_dropped": masked_mean(dropped, m),
    "frac_seq_dropped": masked_mean(jnp.any(dropped & m, axis=1), rows),
    "mean_weight": masked_mean(w, m),
  }
  return w, metrics
