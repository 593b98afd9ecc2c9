"""Rollout/training agreement: how far the rollout's token log-probs are from the training
forward's log-probs of the same tokens.

Under the unified precision flow the two are the same computation and every metric here
sits at its "perfect agreement" value; a mixed-precision setup (FP8 rollout, BF16 training)
shows up as a positive gap that tends to grow with the position in the completion.

With Δ_t = train_logp_t - rollout_logp_t on the masked tokens (N of them), and
r_t = exp(Δ_t) = p_train(y_t) / p_rollout(y_t):

  abs_diff_mean      mean_t |Δ_t|                               (perfect: 0)
  abs_diff_max       max_t |Δ_t|                                (perfect: 0)
  kl_k3              mean_t (r_t - 1 - Δ_t), the k3 estimate of
                     KL(rollout || train) from tokens sampled from the rollout
                     policy (each term >= 0)                    (perfect: 0)
  prob_ratio_error   mean_t exp(|Δ_t|), the mean factor by which
                     the two token probabilities differ         (perfect: 1)
  prob_pearson       Pearson correlation of the token
                     probabilities exp(rollout_logp) and
                     exp(train_logp) over the masked tokens     (perfect: 1)
  ratio_out_frac     fraction of tokens whose ratio r_t lies
                     outside [0.8, 1.2] (`RATIO_BAND`; PPO's
                     default clip range)                        (perfect: 0)
  seq_abs_sum_mean   mean over the rows with a token of
                     |sum_t Δ_t|, the magnitude of the sequence
                     log importance ratio log p_train(y) / p_rollout(y)
                     (not sum_t |Δ_t|, its upper bound)       (perfect: 0)
  seq_abs_sum_max    max over rows of |sum_t Δ_t|             (perfect: 0)
  n_tokens           N
  bin_abs_diff_mean  [n_bins] mean |Δ_t| per position bin (0 for an empty bin)
  bin_count          [n_bins] number of masked tokens per position bin
  row_abs_diff_mean  [B] mean |Δ_t| over each row's masked tokens (0 for a row without
                     one): the completions table's per-row |Δ log p|

Δ is clamped to [-log_clamp, log_clamp] inside the exponentials of `kl_k3` and
`prob_ratio_error` so they cannot overflow. The Pearson correlation is defined when a
variance is 0 (a single token, or all masked probabilities of one side equal): it is then 1 if the two
probability vectors are identical (including when there are no tokens) and 0 otherwise.
With no tokens every other metric is 0. A NaN log-prob on a masked token makes the
metrics NaN.

Position bins: the token at column t of the [B, T] arrays (its position in the completion)
falls in bin i when bin_edges[i] <= t < bin_edges[i + 1]; the last bin is
[bin_edges[-1], ∞). The edges are static: the number of bins does not depend on T.

The keys are named in `jetrl.rl.metrics` (`AGREEMENT_KEYS`); the update step reports them
under "agree/".

Everything is float32 and jit-compatible with `bin_edges` (a tuple) static, e.g.
`jax.jit(agreement_metrics, static_argnames=("bin_edges", "log_clamp"))`.
"""

from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jetrl.rl import metrics as M
from jetrl.rl.masking import as_mask, masked, masked_mean

DEFAULT_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BAND = (0.8, 1.2)

_F32 = jnp.float32


def _check_edges(bin_edges: Sequence[int]) -> tuple[int, ...]:
  try:
    edges = tuple(int(e) for e in bin_edges)
  except TypeError as e:
    raise ValueError(f"bin_edges must be a sequence of ints, got {bin_edges!r}") from e
  if (
    not edges
    or edges[0] != 0
    or any(b <= a for a, b in zip(edges, edges[1:]))
    or any(int(e) != e for e in bin_edges)
  ):
    raise ValueError(f"bin_edges must be strictly increasing ints starting at 0, got {bin_edges!r}")
  return edges


def equal_width_edges(num_bins: int, length: int) -> tuple[int, ...]:
  """Edges of `num_bins` bins of equal width ceil(length / num_bins) covering [0, length)."""
  if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
    raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
  width = max(1, -(-int(length) // num_bins))
  return tuple(i * width for i in range(num_bins))


def position_bins(
  values: chex.Array,
  mask: chex.Array,
  *,
  bin_edges: Sequence[int] | None = None,
  num_bins: int | None = None,
) -> tuple[chex.Array, chex.Array]:
  """Masked mean of a per-token quantity per bin of token positions.

  Give exactly one of `bin_edges` (see the module docstring) or `num_bins` (equal-width bins
  over [0, T), see `equal_width_edges`).

  Args:
    values: [B, T] per-token values (e.g. |Δ log p|).
    mask: [B, T] mask.

  Returns:
    (mean, count): float32 [n_bins] arrays; `mean` is 0 for a bin without tokens.
  """
  chex.assert_rank([values, mask], 2)
  chex.assert_equal_shape([values, mask])
  if (bin_edges is None) == (num_bins is None):
    raise ValueError("give exactly one of bin_edges or num_bins")
  length = values.shape[1]
  edges = _check_edges(bin_edges) if bin_edges is not None else equal_width_edges(num_bins, length)
  ids = np.searchsorted(np.asarray(edges), np.arange(length), side="right") - 1
  m = as_mask(mask)
  col_sum = jnp.sum(masked(values, m), axis=0)
  col_count = jnp.sum(m, axis=0, dtype=_F32)
  # segment_sum adds in float32 (no matmul, so no reduced-precision dot on accelerators).
  sums = jax.ops.segment_sum(col_sum, ids, num_segments=len(edges))
  counts = jax.ops.segment_sum(col_count, ids, num_segments=len(edges))
  return sums / jnp.maximum(counts, 1.0), counts


def agreement_metrics(
  rollout_logp: chex.Array,
  train_logp: chex.Array,
  mask: chex.Array,
  *,
  bin_edges: Sequence[int] = DEFAULT_EDGES,
  log_clamp: float = 20.0,
) -> dict[str, chex.Array]:
  """Rollout/training agreement metrics (see the module docstring for each key).

  Args:
    rollout_logp: [B, T] log-probs of the sampled tokens as the rollout computed them.
    train_logp: [B, T] log-probs of the same tokens from the training forward.
    mask: [B, T] completion mask.
    bin_edges: static position-bin edges (strictly increasing, starting at 0).
    log_clamp: bound on |Δ| inside exponentials.

  Returns:
    dict of float32 scalars, plus the [len(bin_edges)] arrays `bin_abs_diff_mean` and
    `bin_count` and the [B] array `row_abs_diff_mean`.
  """
  chex.assert_rank([rollout_logp, train_logp, mask], 2)
  chex.assert_equal_shape([rollout_logp, train_logp, mask])
  chex.assert_type([rollout_logp, train_logp], float)
  if not log_clamp > 0:
    raise ValueError(f"log_clamp must be > 0, got {log_clamp!r}")

  m = as_mask(mask)
  rollout = masked(rollout_logp, m)
  train = masked(train_logp, m)
  n = jnp.sum(m, dtype=_F32)
  mean = lambda x: masked_mean(x, m)

  delta = train - rollout
  abs_delta = jnp.abs(delta)
  clamped = jnp.clip(delta, -_F32(log_clamp), _F32(log_clamp))
  k3 = jnp.expm1(clamped) - clamped  # expm1: no cancellation for small Δ
  ratio_err = jnp.exp(jnp.abs(clamped))

  p_roll = jnp.exp(rollout)
  p_train = jnp.exp(train)
  c_roll = jnp.where(m, p_roll - mean(p_roll), 0.0)
  c_train = jnp.where(m, p_train - mean(p_train), 0.0)
  cov = jnp.sum(c_roll * c_train)
  denom = jnp.sqrt(jnp.sum(jnp.square(c_roll))) * jnp.sqrt(jnp.sum(jnp.square(c_train)))
  identical = jnp.max(jnp.where(m, jnp.abs(p_roll - p_train), 0.0)) == 0

  def constant(p):
    # Exact test (the float32 mean of equal values may be off by a rounding error, which
    # would leave a tiny spurious variance); true as well when there are no tokens.
    return jnp.max(jnp.where(m, p, -jnp.inf)) <= jnp.min(jnp.where(m, p, jnp.inf))

  degenerate = constant(p_roll) | constant(p_train) | (denom <= 0)
  pearson = jnp.where(
    degenerate,
    jnp.where(identical, _F32(1.0), _F32(0.0)),
    jnp.clip(cov / jnp.where(degenerate, 1.0, denom), -1.0, 1.0),
  )
  # Keep NaN visible: a NaN probability makes denom NaN, and NaN > 0 is false.
  pearson = jnp.where(jnp.isnan(denom), jnp.nan, pearson)

  lo, hi = RATIO_BAND
  ratio = jnp.exp(clamped)
  outside = ((ratio < _F32(lo)) | (ratio > _F32(hi))).astype(_F32)
  outside = jnp.where(jnp.isnan(delta), jnp.nan, outside)  # NaN stays visible
  seq_abs = jnp.abs(jnp.sum(delta, axis=1))
  has_tok = jnp.any(m, axis=1)
  n_rows = jnp.sum(has_tok, dtype=_F32)
  seq_abs_mean = jnp.sum(jnp.where(has_tok, seq_abs, 0.0)) / jnp.maximum(n_rows, 1.0)

  bin_mean, bin_count = position_bins(abs_delta, m, bin_edges=bin_edges)
  return {
    M.ABS_DIFF_MEAN: mean(abs_delta),
    M.ABS_DIFF_MAX: jnp.max(jnp.where(m, abs_delta, 0.0)),
    M.KL_K3: mean(k3),
    M.PROB_RATIO_ERROR: mean(ratio_err),
    M.PROB_PEARSON: pearson.astype(_F32),
    M.RATIO_OUT_FRAC: mean(outside),
    M.SEQ_ABS_SUM_MEAN: seq_abs_mean,
    M.SEQ_ABS_SUM_MAX: jnp.max(jnp.where(has_tok, seq_abs, 0.0)),
    M.N_TOKENS: n,
    M.BIN_ABS_DIFF_MEAN: bin_mean,
    M.BIN_COUNT: bin_count,
    M.ROW_ABS_DIFF_MEAN: jnp.sum(jnp.where(m, abs_delta, 0.0), axis=1)
    / jnp.maximum(jnp.sum(m, axis=1, dtype=_F32), 1.0),
  }
