"""Policy losses over per-token arrays: PPO-clip (GRPO / DAPO / Dr.GRPO), KL, entropy.

(GSPO and CISPO are in `jetrl.rl.ratio_losses`; the table naming every loss the update
accepts is `jetrl.rl.objective.LOSS_SPECS`.)

Conventions shared by every function here:

* Per-token arrays are [B, T] (B completions, T completion positions) and come with a
  completion mask [B, T] (bool or {0, 1}); masked-out positions never contribute, whatever
  they hold (their inputs are replaced by zeros before any arithmetic, so even a NaN or Inf
  there leaves values and gradients finite).
* All math is float32, whatever the input dtype.
* A loss is returned as a pair `(num, den)` of float32 scalars such that the loss is
  `num / den` and micro-batches combine exactly: `sum_i num_i / sum_i den_i` over the
  micro-batches of a batch equals the full-batch loss. `finalize_loss(num, den)` does the
  division (0 when den is 0, i.e. nothing was selected).

Aggregations (`AGGREGATIONS`), with l[b, t] the per-token loss and m[b, t] the mask:

  "token"               num = sum_bt m*l              den = sum_bt m  (number of tokens)
                        (DAPO token-level mean: every token weighs the same)
  "seq_mean_token_mean" num = sum_b (sum_t m*l / n_b) den = #{b : n_b > 0}
                        with n_b = sum_t m[b, t]; a row without tokens adds 0 to both
                        (GRPO: mean over tokens within a sequence, then over sequences)
  "constant"            num = sum_bt m*l              den = B * max_tokens
                        (Dr.GRPO: a constant normaliser; `max_tokens` defaults to T, the
                        padded length; pass the generation budget explicitly when
                        micro-batches may be padded to different lengths)

Function arguments that pick a mode (`aggregation`, `estimator`, clip values, `max_tokens`)
are Python values, static under `jit`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jetrl.rl.masking import as_mask, masked, masked_mean

AGGREGATIONS = ("token", "seq_mean_token_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")

_F32 = jnp.float32


def _check_aggregation(aggregation: str) -> None:
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")


def _check_tokens(*arrays: chex.Array, mask: chex.Array) -> None:
  chex.assert_rank(mask, 2)
  chex.assert_rank(list(arrays), 2)
  chex.assert_equal_shape([*arrays, mask])
  chex.assert_type(list(arrays), float)


def aggregate(
  per_token: chex.Array,
  mask: chex.Array,
  aggregation: str = "token",
  *,
  max_tokens: int | None = None,
) -> tuple[chex.Array, chex.Array]:
  """Reduces a per-token quantity [B, T] to `(num, den)` (see the module docstring).

  Args:
    per_token: [B, T] float values.
    mask: [B, T] completion mask.
    aggregation: one of `AGGREGATIONS`.
    max_tokens: for "constant" only: the per-sequence token budget in the denominator
      (defaults to T). Ignored by the other aggregations.

  Returns:
    (num, den): float32 scalars; the aggregated value is `num / den`.
  """
  _check_aggregation(aggregation)
  _check_tokens(per_token, mask=mask)
  m = as_mask(mask)
  x = masked(per_token, m)
  if aggregation == "token":
    return jnp.sum(x), jnp.sum(m, dtype=_F32)
  if aggregation == "seq_mean_token_mean":
    n = jnp.sum(m, axis=1, dtype=_F32)
    seq_mean = jnp.sum(x, axis=1) / jnp.maximum(n, 1.0)
    return jnp.sum(seq_mean), jnp.sum(n > 0, dtype=_F32)
  # "constant"
  if max_tokens is None:
    max_tokens = per_token.shape[1]
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
    raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
  return jnp.sum(x), _F32(per_token.shape[0] * max_tokens)


def finalize_loss(num: chex.Array, den: chex.Array) -> chex.Array:
  """`num / den`, or 0 when `den` is 0 (no token / sequence selected, so `num` is 0 too)."""
  num = jnp.asarray(num, _F32)
  den = jnp.asarray(den, _F32)
  return num / jnp.where(den > 0, den, _F32(1.0))


def check_clip_range(
  clip_low: float, clip_high: float, aggregation: str, *, low_may_be_one: bool = False
) -> None:
  """A policy loss's static arguments: clip_low, clip_high >= 0; clip_low < 1 (<= 1 with
  `low_may_be_one`: a lower bound of 0 on a ratio that carries no gradient); a known
  aggregation."""
  _check_aggregation(aggregation)
  for name, v in (("clip_low", clip_low), ("clip_high", clip_high)):
    if isinstance(v, (int, float)) and not v >= 0:
      raise ValueError(f"{name} must be >= 0, got {v!r}")
  if isinstance(clip_low, (int, float)) and (
    clip_low > 1 or (clip_low == 1 and not low_may_be_one)
  ):
    bound = "<= 1" if low_may_be_one else "< 1"
    raise ValueError(
      f"clip_low must be {bound} (the lower bound is 1 - clip_low), got {clip_low!r}"
    )


def policy_inputs(
  logp: chex.Array,
  old_logp: chex.Array,
  advantages: chex.Array,
  mask: chex.Array,
  is_weights: chex.Array | None = None,
) -> tuple[chex.Array, chex.Array, chex.Array, chex.Array, chex.Array | None]:
  """A policy loss's arrays, checked: (bool mask, logp, old_logp, advantages broadcast to
  [B, T], is_weights or None), float32 and 0 outside the mask; all but logp detached."""
  _check_tokens(logp, old_logp, mask=mask)
  chex.assert_rank(advantages, {1, 2})
  chex.assert_type(advantages, float)
  if jnp.ndim(advantages) == 1:
    chex.assert_shape(advantages, (logp.shape[0],))
    advantages = jnp.broadcast_to(jnp.asarray(advantages)[:, None], logp.shape)
  else:
    chex.assert_equal_shape([advantages, logp])
  m = as_mask(mask)
  new = masked(logp, m)
  old = jax.lax.stop_gradient(masked(old_logp, m))
  adv = jax.lax.stop_gradient(masked(advantages, m))
  w = None
  if is_weights is not None:
    chex.assert_equal_shape([is_weights, logp])
    w = jax.lax.stop_gradient(masked(is_weights, m))
  return m, new, old, adv, w


def clipped_ratio_loss(
  ratio: chex.Array,
  adv: chex.Array,
  m: chex.Array,
  w: chex.Array | None,
  *,
  clip_low: float,
  clip_high: float,
  aggregation: str,
  max_tokens: int | None,
  dual_clip: float | None = None,
) -> tuple[chex.Array, chex.Array, dict[str, chex.Array]]:
  """PPO's clipped surrogate of a given [B, T] ratio (PPO's per token, GSPO's per sequence)
  on the arrays of `policy_inputs`: `ppo_clip_loss`'s (num, den, metrics) after the ratio."""
  clipped = jnp.clip(ratio, _F32(1.0 - clip_low), _F32(1.0 + clip_high))
  per_token = jnp.maximum(-ratio * adv, -clipped * adv)
  if dual_clip is not None:
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, -_F32(dual_clip) * adv), per_token)
  if w is not None:
    per_token = per_token * w
  num, den = aggregate(per_token, m, aggregation, max_tokens=max_tokens)

  r = jax.lax.stop_gradient(ratio)
  low = (adv < 0) & (r < 1.0 - clip_low)
  high = (adv > 0) & (r > 1.0 + clip_high)
  if dual_clip is not None:
    dual = (adv < 0) & (r > dual_clip)
  else:
    dual = jnp.zeros_like(m)
  metrics = ratio_metrics(r, low, high, m)
  metrics["dual_clip_frac"] = masked_mean(dual, m)
  return num, den, metrics


def ratio_metrics(ratio, low, high, mask) -> dict[str, chex.Array]:
  """The metrics every policy loss returns (token means over the mask): the fractions of
  tokens where the lower / upper clip binds, the mean ratio and the token count."""
  return {
    "clip_frac_low": masked_mean(low, mask),
    "clip_frac_high": masked_mean(high, mask),
    "ratio_mean": masked_mean(ratio, mask),
    "n_tokens": jnp.sum(mask, dtype=_F32),
  }


def ppo_clip_loss(
  logp: chex.Array,
  old_logp: chex.Array,
  advantages: chex.Array,
  mask: chex.Array,
  *,
  clip_low: float = 0.2,
  clip_high: float = 0.2,
  aggregation: str = "token",
  max_tokens: int | None = None,
  is_weights: chex.Array | None = None,
  dual_clip: float | None = None,
) -> tuple[chex.Array, chex.Array, dict[str, chex.Array]]:
  """PPO clipped surrogate loss, as used by GRPO, DAPO (clip-higher) and Dr.GRPO.

  With r = exp(logp - old_logp) and A the advantage, the per-token loss is

    l = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

  `clip_high > clip_low` is DAPO's clip-higher. With `dual_clip = c > 1` (dual-clip PPO), the
  loss of a token with A < 0 is further capped at `-c * A`, so a huge ratio on a negative
  advantage cannot give an unbounded loss. With `is_weights` (from `jetrl.rl.correction`),
  l is multiplied by those weights, which carry no gradient.

  `old_logp`, `advantages` and `is_weights` are treated as constants (stop_gradient); the
  gradient flows through `logp` only. The ratio is not clamped: a log-ratio above ~88 nats
  overflows float32 to Inf, which then shows in the loss rather than being hidden.

  Args:
    logp: [B, T] log-probs of the sampled tokens under the policy being trained.
    old_logp: [B, T] log-probs of the same tokens under the behaviour policy.
    advantages: [B] per-sequence (broadcast over tokens) or [B, T] per-token advantages.
    mask: [B, T] completion mask.
    clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high].
    aggregation: one of `AGGREGATIONS` (see the module docstring).
    max_tokens: token budget for the "constant" aggregation (defaults to T).
    is_weights: optional [B, T] multiplicative per-token weights (detached).
    dual_clip: optional c > 1 for dual-clip PPO.

  Returns:
    (num, den, metrics): the loss is `num / den`; metrics are float32 scalars, token means
    over the masked tokens of this call (weight them by `n_tokens` to combine calls):
      clip_frac_low:  tokens with A < 0 and r < 1 - clip_low (lower clip binds),
      clip_frac_high: tokens with A > 0 and r > 1 + clip_high (upper clip binds),
      dual_clip_frac: tokens with A < 0 and r > dual_clip (0 without dual clip),
      ratio_mean:     mean of r,
      n_tokens:       number of masked tokens.
  """
  check_clip_range(clip_low, clip_high, aggregation)
  if dual_clip is not None and not dual_clip > 1:
    raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
  m, new, old, adv, w = policy_inputs(logp, old_logp, advantages, mask, is_weights)
  return clipped_ratio_loss(
    jnp.exp(new - old),
    adv,
    m,
    w,
    clip_low=clip_low,
    clip_high=clip_high,
    aggregation=aggregation,
    max_tokens=max_tokens,
    dual_clip=dual_clip,
  )


def kl_penalty(
  logp: chex.Array,
  ref_logp: chex.Array,
  mask: chex.Array,
  *,
  estimator: str = "k3",
  clamp: float | None = 20.0,
) -> chex.Array:
  """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

  With d = ref_logp - logp = log(pi_ref / pi) at each sampled token:
    "k1": -d                    (unbiased, high variance, can be negative)
    "k2": d**2 / 2              (biased, low variance)
    "k3": exp(d) - d - 1        (unbiased, >= 0, low variance); d is first clamped to
                                [-clamp, clamp] (no clamp with `clamp=None`) so exp cannot
                                overflow; the gradient is 0 where the clamp binds.

  `ref_logp` is a frozen reference (stop_gradient); gradients flow through `logp`.
  Aggregate the result with `aggregate(kl, mask, aggregation)` like the policy loss.

  Returns:
    [B, T] float32 per-token KL estimates, 0 at masked-out positions.
  """
  _check_tokens(logp, ref_logp, mask=mask)
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; accepted: {', '.join(KL_ESTIMATORS)}")
  if clamp is not None and not clamp > 0:
    raise ValueError(f"clamp must be > 0 or None, got {clamp!r}")
  m = as_mask(mask)
  d = jax.lax.stop_gradient(masked(ref_logp, m)) - masked(logp, m)
  if estimator == "k1":
    kl = -d
  elif estimator == "k2":
    kl = 0.5 * jnp.square(d)
  else:
    if clamp is not None:
      d = jnp.clip(d, -_F32(clamp), _F32(clamp))
    kl = jnp.expm1(d) - d  # = exp(d) - d - 1, accurate for small d
  return jnp.where(m, kl, _F32(0.0))


def entropy_bonus(
  entropy: chex.Array,
  mask: chex.Array,
  aggregation: str = "token",
  *,
  max_tokens: int | None = None,
) -> tuple[chex.Array, chex.Array]:
  """Aggregated per-token policy entropy, `(num, den)`.

  The value `num / den` is the (positive) entropy; an entropy bonus with coefficient c
  enters the loss as `- c * num / den`.
  """
  return aggregate(entropy, mask, aggregation, max_tokens=max_tokens)


def overlong_penalty(
  lengths: chex.Array,
  max_len: int,
  buffer_len: int,
  penalty_factor: float = 1.0,
) -> chex.Array:
  """DAPO soft overlong punishment: a per-sequence reward term (0 or negative).

  With L the completion length, L_max = `max_len` and L_cache = `buffer_len`:
    0                                          if L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache * factor if L_max - L_cache < L <= L_max
    -factor                                    if L > L_max

  Args:
    lengths: [B] completion lengths in tokens (int or float).
    max_len: L_max (static).
    buffer_len: L_cache, the soft-punishment interval, 0 < buffer_len <= max_len (static).
    penalty_factor: the penalty at L_max and beyond (>= 0).

  Returns:
    [B] float32 penalties to add to the rewards.
  """
  if not 0 < buffer_len <= max_len:
    raise ValueError(
      f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len!r}, max_len={max_len!r}"
    )
  if isinstance(penalty_factor, (int, float)) and not penalty_factor >= 0:
    raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor!r}")
  chex.assert_rank(lengths, 1)
  length = jnp.asarray(lengths).astype(_F32)
  start = _F32(max_len - buffer_len)
  factor = _F32(penalty_factor)
  soft = (start - length) / _F32(buffer_len) * factor
  return jnp.where(length <= start, _F32(0.0), jnp.where(length <= _F32(max_len), soft, -factor))


def truncation_mask(truncated: chex.Array, mask: chex.Array) -> chex.Array:
  """Masks out every token of the completions that were truncated (hit the length limit).

  Args:
    truncated: [B] bool, true for a completion cut off before it ended.
    mask: [B, T] completion mask.

  Returns:
    the mask with truncated rows zeroed, in the dtype of `mask`.
  """
  chex.assert_rank(truncated, 1)
  chex.assert_rank(mask, 2)
  chex.assert_shape(truncated, (mask.shape[0],))
  keep = jnp.logical_not(jnp.asarray(truncated).astype(bool))[:, None]
  mask = jnp.asarray(mask)
  return jnp.where(keep, mask, jnp.zeros_like(mask))
