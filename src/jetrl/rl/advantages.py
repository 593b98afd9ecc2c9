"""Advantages (the table `ADVANTAGE_SPECS`: GRPO, Dr.GRPO, RLOO, REINFORCE++), batch
normalisation, DAPO dynamic sampling.

Rewards come in groups: each of P prompts is sampled G = `group_size` times, and the G
completions of a prompt are contiguous, so a flat reward vector [P*G] reshapes to [P, G].
An advantage is one per completion (the same for all of its tokens). `--update.advantage`
names an entry of `ADVANTAGE_SPECS`; left unset, the loss's own (`jetrl.rl.objective`).

All math is float32. Everything here is jit-compatible; `group_size` is static.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import chex
import jax.numpy as jnp


def _as_groups(rewards: chex.Array, group_size: int) -> chex.Array:
  """[P*G] or [P, G] float rewards -> [P, G] float32."""
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  chex.assert_rank(rewards, {1, 2})
  rewards = jnp.asarray(rewards)
  if rewards.ndim == 2:
    if rewards.shape[1] != group_size:
      raise ValueError(f"rewards of shape {rewards.shape} must be [P, group_size={group_size}]")
  elif rewards.shape[0] % group_size:
    raise ValueError(
      f"rewards of length {rewards.shape[0]} is not a multiple of group_size={group_size}"
    )
  return rewards.astype(jnp.float32).reshape(-1, group_size)


def group_advantages(
  rewards: chex.Array,
  group_size: int,
  *,
  normalize_std: bool = True,
  eps: float = 1e-6,
) -> chex.Array:
  """Group-relative advantages, one per completion.

  GRPO (`normalize_std=True`):   A_i = (r_i - mean_g) / (std_g + eps)
  Dr.GRPO (`normalize_std=False`): A_i = r_i - mean_g

  `mean_g` and `std_g` are over the G completions of the same prompt; `std_g` is the
  population standard deviation (ddof=0, i.e. divided by G, not G - 1).

  A group whose rewards are all equal gets advantages of exactly 0 (the float32 mean of equal
  values may differ from them by a rounding error, which eps would otherwise blow up).
  A NaN or Inf reward makes its whole group's advantages non-finite.

  Args:
    rewards: [P*G] (groups contiguous) or [P, G] rewards.
    group_size: G, the number of completions per prompt (static).
    normalize_std: divide by the group std (GRPO) or not (Dr.GRPO).
    eps: added to the std before dividing.

  Returns:
    float32 advantages with the shape of `rewards`.
  """
  shape = jnp.shape(rewards)
  r = _as_groups(rewards, group_size)
  mean = jnp.mean(r, axis=1, keepdims=True)
  centered = r - mean
  if normalize_std:
    std = jnp.sqrt(jnp.mean(jnp.square(centered), axis=1, keepdims=True))
    adv = centered / (std + jnp.float32(eps))
  else:
    adv = centered
  constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
  adv = jnp.where(constant, jnp.float32(0.0), adv)
  return adv.reshape(shape)


def batch_normalize(
  adv: chex.Array,
  mask: chex.Array | None = None,
  *,
  eps: float = 1e-6,
  center: bool = True,
) -> chex.Array:
  """Normalises advantages over the whole batch: (A - mean) / (std + eps).

  Statistics are over the entries where `mask` is true (all entries if `mask` is None), with
  the population std (ddof=0). Masked-out entries come back as 0. With `center=False` only
  the division by the std is applied. If no entry is selected, the result is all zeros.

  Args:
    adv: advantages of any shape, e.g. [B] or [B, T].
    mask: optional bool / {0, 1} array of the same shape.
    eps: added to the std before dividing.
    center: subtract the batch mean first.

  Returns:
    float32 array of the shape of `adv`.
  """
  adv = jnp.asarray(adv).astype(jnp.float32)
  if mask is None:
    m = jnp.ones(adv.shape, dtype=bool)
  else:
    chex.assert_equal_shape([adv, mask])
    m = jnp.asarray(mask).astype(bool)
  a = jnp.where(m, adv, 0.0)
  n = jnp.maximum(jnp.sum(m, dtype=jnp.float32), 1.0)
  mean = jnp.sum(a) / n
  centered = jnp.where(m, adv - mean, 0.0)
  std = jnp.sqrt(jnp.sum(jnp.square(centered)) / n)
  out = (centered if center else a) / (std + jnp.float32(eps))
  return jnp.where(m, out, 0.0)


def dynamic_sampling_mask(rewards: chex.Array, group_size: int) -> tuple[chex.Array, chex.Array]:
  """DAPO dynamic sampling: drops the groups whose rewards are all equal.

  Such groups (all correct or all wrong) have zero group-relative advantage and give no
  policy-gradient signal. A group holding a NaN is kept (never silently dropped).

  Args:
    rewards: [P*G] (groups contiguous) or [P, G] rewards.
    group_size: G (static).

  Returns:
    (keep, n_dropped): `keep` is a [P] bool array, true for the groups to keep; `n_dropped`
    is an int32 scalar, the number of groups dropped.
  """
  r = _as_groups(rewards, group_size)
  constant = jnp.max(r, axis=1) == jnp.min(r, axis=1)
  keep = jnp.logical_not(constant)
  return keep, jnp.sum(constant, dtype=jnp.int32)


def rloo_advantages(rewards: chex.Array, group_size: int) -> chex.Array:
  """RLOO (REINFORCE leave-one-out): A_i = r_i - mean of the other G - 1 rewards of its group,
  i.e. G / (G - 1) times Dr.GRPO's r_i - mean_g. A group whose rewards are all equal gets
  exactly 0; G must be >= 2. float32, the shape of `rewards`."""
  if group_size < 2:
    raise ValueError(f"RLOO needs group_size >= 2 (a leave-one-out mean), got {group_size!r}")
  shape = jnp.shape(rewards)
  r = _as_groups(rewards, group_size)
  others = (jnp.sum(r, axis=1, keepdims=True) - r) / jnp.float32(group_size - 1)
  constant = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
  return jnp.where(constant, jnp.float32(0.0), r - others).reshape(shape)


def reinforce_pp_advantages(
  rewards: chex.Array, group_size: int, *, baseline: bool = False, eps: float = 1e-6
) -> chex.Array:
  """REINFORCE++: the rewards normalised over the whole batch (all P*G completions),
  A_i = (r_i - mean_B) / (std_B + eps), population std; no per-group statistics.
  `baseline=True` (REINFORCE++-baseline) subtracts the group mean first (a group of equal
  rewards gets exactly 0 there) and normalises those values over the batch. A batch whose
  values are all equal gets 0. float32, the shape of `rewards`."""
  shape = jnp.shape(rewards)
  r = _as_groups(rewards, group_size)
  if baseline:
    r = group_advantages(r, group_size, normalize_std=False)
  return batch_normalize(r, eps=eps).reshape(shape)


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
  """One advantage estimator of the table.

  function: (rewards [P*G] or [P, G], group_size) -> float32 advantages of that shape.
  group_std: divides each group by its own std (a per-prompt scale, which Dr.GRPO removes).
  summary: the formula in words, for the `update.advantage` help.
  """

  function: Callable[[chex.Array, int], chex.Array]
  group_std: bool
  summary: str


ADVANTAGE_SPECS: Mapping[str, AdvantageSpec] = {
  "grpo": AdvantageSpec(
    functools.partial(group_advantages, normalize_std=True),
    True,
    "(r - group mean) / (group std + 1e-6)",
  ),
  "dr_grpo": AdvantageSpec(
    functools.partial(group_advantages, normalize_std=False), False, "r - group mean"
  ),
  "rloo": AdvantageSpec(rloo_advantages, False, "r - mean of the group's other G - 1 rewards"),
  "reinforce_pp": AdvantageSpec(
    reinforce_pp_advantages,
    False,
    "(r - batch mean) / (batch std + 1e-6) over the whole batch, no group baseline",
  ),
  "reinforce_pp_baseline": AdvantageSpec(
    functools.partial(reinforce_pp_advantages, baseline=True),
    False,
    "r - group mean, then normalised over the whole batch",
  ),
}
ADVANTAGES = tuple(ADVANTAGE_SPECS)


def compute_advantages(rewards: chex.Array, group_size: int, kind: str) -> chex.Array:
  """The advantages of the table's entry `kind` (one per completion)."""
  if kind not in ADVANTAGE_SPECS:
    raise ValueError(f"unknown advantage {kind!r}; accepted: {', '.join(ADVANTAGES)}")
  return ADVANTAGE_SPECS[kind].function(rewards, group_size)
