"""The update's state: what is trained, the optimizer's state, and what stays frozen.

`TrainState` is the one state the jitted update (`jetrl.rl.update`) takes and returns (donated);
`init_train_state` builds it for a full-parameter run, `init_lora_train_state` for a LoRA run.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from jetrl.kernels import Device, KernelConfig, resolve_plan
from jetrl.models.lora import LoraConfig, freeze_base
from jetrl.precision import Precision
from jetrl.rl.optimizer import OptimizerConfig, SkipNonFiniteState, make_optimizer
from jetrl.rl.update_config import UpdateConfig


class TrainState(NamedTuple):
  params: Any  # what is trained: the model's params, or a LoRA run's adapters
  opt_state: SkipNonFiniteState
  ref_params: Any = None  # frozen reference policy (only when kl_coef > 0, not LoRA)
  # A LoRA run's frozen base (jetrl.models.lora.freeze_base): the model is attach(frozen,
  # params), and the base alone is the reference policy. Rebuilt at start, not checkpointed.
  frozen: Any = None

  @property
  def step(self) -> jax.Array:
    """int32: optimizer steps taken (skipped ones excluded)."""
    return self.opt_state.applied

  @property
  def skipped(self) -> jax.Array:
    """int32: optimizer steps skipped for a non-finite loss, gradient or result."""
    return self.opt_state.skipped


def init_train_state(
  params, cfg: UpdateConfig = UpdateConfig(), optimizer: OptimizerConfig = OptimizerConfig()
) -> TrainState:
  """Cast params to the master dtype and build the optimizer state.

  The state owns fresh buffers (update_step donates it), so `params` stays usable. (The
  optimizer's state does not depend on the schedule's length.)
  """
  dtype = jnp.dtype(cfg.master_dtype)
  copy = lambda tree: jax.tree_util.tree_map(lambda a: jnp.array(a, dtype=dtype, copy=True), tree)
  params = copy(params)
  ref = copy(params) if cfg.kl_coef > 0 else None
  return TrainState(
    params=params, opt_state=make_optimizer(optimizer, 1).init(params), ref_params=ref
  )


def init_lora_train_state(
  base,
  adapters,
  lora: LoraConfig,
  precision: Optional[Precision],
  cfg: UpdateConfig = UpdateConfig(),
  optimizer: OptimizerConfig = OptimizerConfig(),
  kernels: Union[KernelConfig, Device, None] = None,
) -> TrainState:
  """The train state of a LoRA run: the adapters (in the master dtype) are the params and
  the optimizer's state; the base, cast to the master dtype, is frozen (quantized once under
  an FP8 training precision, `jetrl.models.lora.freeze_base`, in the layout the update's plan
  for `kernels` reads: the settings or the device, as `update_step` takes them) and serves as
  the reference."""
  if not lora.enabled:
    raise ValueError("init_lora_train_state: LoraConfig.rank is 0; use init_train_state")
  dtype = jnp.dtype(cfg.master_dtype)
  copy = lambda tree: jax.tree_util.tree_map(lambda a: jnp.array(a, dtype=dtype, copy=True), tree)
  adapters = copy(adapters)
  return TrainState(
    params=adapters,
    opt_state=make_optimizer(optimizer, 1).init(adapters),
    frozen=freeze_base(copy(base), precision, resolve_plan(precision, kernels)),
  )
