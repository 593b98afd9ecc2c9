"""The optimizer of every run (RL and SFT): global-norm clipping, AdamW, a learning-rate
schedule, and the skip of non-finite steps as an optax transformation.

`make_optimizer(config, total_steps)` is the one builder; `OptimizerConfig` is the `optimizer`
node of a run's configuration (`--optimizer.lr`, ...). Its value is static under `jit` (frozen,
hashable), so two runs with equal configs share their compiled steps.

`skip_non_finite(inner)` wraps a transformation so that a step whose loss (passed as
`value=`), gradients, update, new params or new optimizer state holds a NaN or Inf is skipped:
the update it returns is zero and the inner state stays as it was, and the step is counted
(`applied` / `skipped` in its state). Checking the result as well as the gradients catches what
finite gradients can still produce (a NaN already in the optimizer state, an overflowing
update), so nothing non-finite reaches the params (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jetrl.config import ConfigError, check_fields, field

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a warmup + constant or cosine schedule."""

  lr: float = field(1e-4, "Peak learning rate.", lo=0.0, hi=1.0, lo_open=True, former=("lr",))
  schedule: str = field(
    "constant",
    "Learning-rate schedule after the linear warmup.",
    choices=SCHEDULES,
    former=("schedule",),
  )
  warmup_steps: int = field(
    0, "Optimizer steps of linear warmup from 0 to lr.", lo=0, former=("warmup_steps",)
  )
  end_lr_ratio: float = field(
    0.1, "Final learning rate of the cosine schedule, as a fraction of lr.", lo=0.0, hi=1.0
  )
  weight_decay: float = field(0.0, "AdamW weight decay.", lo=0.0, hi=10.0, former=("weight_decay",))
  max_grad_norm: float = field(
    1.0, "Global-norm gradient clipping.", lo=0.0, hi=1e6, lo_open=True, former=("max_grad_norm",)
  )
  b1: float = field(0.9, "AdamW first-moment decay.", lo=0.0, hi=1.0)
  b2: float = field(0.999, "AdamW second-moment decay.", lo=0.0, hi=1.0)
  eps: float = field(1e-8, "AdamW epsilon.", lo=0.0, hi=1.0, lo_open=True)

  def __post_init__(self):
    check_fields(self)
    for name in ("b1", "b2"):
      if getattr(self, name) >= 1.0:
        raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)!r}")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """The learning rate at each optimizer step of a run of `total_steps` steps: a linear warmup
  over min(warmup_steps, total_steps) steps, then constant, or a cosine decay to
  end_lr_ratio * lr at `total_steps`."""
  warm = min(cfg.warmup_steps, total_steps)
  if cfg.schedule == "constant":
    if not warm:
      return optax.constant_schedule(cfg.lr)
    return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warm), optax.constant_schedule(cfg.lr)], [warm]
    )
  return optax.warmup_cosine_decay_schedule(
    0.0, cfg.lr, max(warm, 1), max(total_steps, warm + 1), end_value=cfg.end_lr_ratio * cfg.lr
  )


def schedule_key(cfg: OptimizerConfig, total_steps: int) -> tuple:
  """What the schedule depends on: two runs with the same key follow the same learning rate,
  step for step (a resumed run may change its length only if this stays the same)."""
  warm = min(cfg.warmup_steps, total_steps)
  return (
    cfg.schedule,
    cfg.lr,
    warm,
    cfg.end_lr_ratio if cfg.schedule == "cosine" else None,
    total_steps if cfg.schedule == "cosine" else None,
  )


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
  """Clip by global norm, AdamW on `learning_rate_schedule`, non-finite steps skipped."""
  return skip_non_finite(
    optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(
        learning_rate_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mu_dtype=jnp.float32,
      ),
    )
  )


def all_finite(tree) -> jax.Array:
  """A bool scalar: every leaf of `tree` is free of NaN and Inf (True for no leaves)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class SkipNonFiniteState(NamedTuple):
  inner: Any
  applied: jax.Array  # int32: steps applied
  skipped: jax.Array  # int32: steps skipped for a non-finite value
  last_ok: jax.Array  # bool: the last step was applied


def skip_non_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner`, with every step that would bring a NaN or Inf skipped and counted.

  `update(grads, state, params, value=loss)`: the step is applied only when the loss (if
  given), the gradients, `inner`'s update, the params it would produce and `inner`'s new state
  are all finite; otherwise the returned update is zero and the state is the old one.
  """
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return SkipNonFiniteState(
      inner.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.array(True)
    )

  def update(
    grads, state: SkipNonFiniteState, params=None, *, value: Optional[Any] = None, **extra
  ):
    ok = all_finite(grads) & jnp.isfinite(optax.tree.norm(grads))
    if value is not None:
      ok = ok & jnp.all(jnp.isfinite(value))
    # The inner step runs on the gradients as they are; a non-finite one makes its result
    # non-finite, which is discarded below. (Selecting zeros in their place changes how XLA
    # fuses the clipping norm, and with it the last bits of every step.)
    updates, new_inner = inner.update(grads, state.inner, params, **extra)
    ok = ok & all_finite(updates) & all_finite(new_inner)
    if params is not None:  # the result, not only its inputs
      ok = ok & all_finite(optax.apply_updates(params, updates))
    updates = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    new_inner = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new_inner, state.inner)
    return updates, SkipNonFiniteState(
      new_inner, state.applied + ok.astype(jnp.int32), state.skipped + (~ok).astype(jnp.int32), ok
    )

  return optax.GradientTransformationExtraArgs(init, update)
