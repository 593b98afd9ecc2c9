"""The product's jitted programs, traced on abstract arguments placed on compile-only devices.

Each builder returns `Program`s: the jitted function jetrl runs (the sampler's rollout weights,
prefill and decode loop; the RL update step with its backward and optimizer; the SFT step),
with `jax.ShapeDtypeStruct` arguments that carry the target's shardings, and the target's
`jetrl.kernels.Device` (`jetrl.aot.targets.target_device`) passed to it as the device its plan
is resolved for, as a run passes its kernel settings. `Program.compile()` lowers and compiles
it for the target; nothing is allocated or run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jetrl.kernels import Device, resolve_plan
from jetrl.models import ModelConfig, init_params
from jetrl.models.lora import LoraConfig, init_adapters
from jetrl.parallel import make_layout, make_mesh
from jetrl.precision import Recipe
from jetrl.rl import (
  OptimizerConfig,
  UpdateConfig,
  init_lora_train_state,
  init_train_state,
  make_optimizer,
  make_train_batch,
)
from jetrl.rl.update import jit_update_step
from jetrl.sampling import SamplingConfig
from jetrl.sampling import sampler as _sampler
from jetrl.train.sft import sft_step


@dataclasses.dataclass
class Program:
  """One jitted program and its abstract arguments. `steps`: how many times one call runs
  each of its `while` loops, in order (the decode loop's segments); empty for straight code."""

  name: str
  fn: Callable
  args: tuple
  kwargs: dict
  steps: tuple[int, ...] = ()
  tokens: int = 0  # tokens one call processes (for MFU: the update's rows x sequence)
  device: Optional[Device] = None  # the device its plan is resolved for

  def compile(self):
    return self.fn.trace(*self.args, **self.kwargs).lower().compile()


def _abstract(tree, sharding):
  """ShapeDtypeStructs of `tree`'s leaves, each with `sharding` (one, or a matching tree)."""
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
    )
  return jax.tree_util.tree_map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sharding
  )


def _sds(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def abstract_params(config: ModelConfig, dtype) -> Any:
  return jax.eval_shape(lambda k: init_params(config, k, dtype=dtype), jax.random.PRNGKey(0))


def one_device_sharding(devices) -> NamedSharding:
  return NamedSharding(Mesh(devices[:1], ("x",)), P())


def rollout_programs(
  config: ModelConfig,
  recipe: Recipe,
  devices,
  *,
  device: Device,
  batch: int,
  prompt_len: int,
  new_tokens: int,
  param_dtype=jnp.bfloat16,
  segments: Optional[tuple[int, ...]] = None,
) -> list[Program]:
  """The sampler as `jetrl.sampling.sample` runs it on one device: the rollout weights (each
  projection quantized once per rollout), the prefill and the decode loop (its segments:
  `decode_segments`, or `segments` to compile another split, such as one loop), for `device`
  (the plan `sample` resolves there)."""
  rep = one_device_sharding(devices)
  scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, prompt_len=prompt_len)
  prec = recipe.rollout
  plan = resolve_plan(prec, device)
  params = _abstract(abstract_params(config, param_dtype), rep)
  rw_kw = dict(precision=prec, fuse=True, plan=plan)
  rw = jax.eval_shape(lambda p: _sampler.rollout_params(p, **rw_kw), params)
  rparams = _abstract(rw, rep)
  tokens = _sds((batch, prompt_len), jnp.int32, rep)
  mask = _sds((batch, prompt_len), bool, rep)
  cache_dtype = _sampler.activation_dtype(prec, params)
  pre_kw = dict(
    model_config=config, config=scfg, precision=prec, cache_dtype=cache_dtype, plan=plan
  )
  cache, logits = jax.eval_shape(
    lambda p, t, m: _sampler._prefill(p, t, m, **pre_kw), rparams, tokens, mask
  )
  segments = segments or _sampler.decode_segments(new_tokens)
  steps = tuple(b - a for a, b in zip((0,) + segments[:-1], segments))
  dec_kw = dict(model_config=config, config=scfg, precision=prec, segments=segments, plan=plan)
  return [
    Program("rollout_weights", _sampler.rollout_params, (params,), rw_kw, device=device),
    Program(
      "prefill",
      _sampler._prefill,
      (rparams, tokens, mask),
      pre_kw,
      tokens=batch * prompt_len,
      device=device,
    ),
    Program(
      "decode",
      _sampler._decode,
      (
        rparams,
        _abstract(cache, rep),
        _abstract(logits, rep),
        _sds((batch,), jnp.int32, rep),
        _sds((2,), jnp.uint32, rep),
      ),
      dec_kw,
      steps=steps,
      tokens=batch * new_tokens,
      device=device,
    ),
  ]


def _batch(rows: int, prompt_len: int, completion_len: int):
  z = lambda s, d: jnp.zeros(s, d)
  return jax.eval_shape(
    lambda: make_train_batch(
      z((rows, prompt_len), jnp.int32),
      z((rows, prompt_len), bool),
      z((rows, completion_len), jnp.int32),
      z((rows, completion_len), bool),
      z((rows, completion_len), jnp.float32),
      z((rows,), jnp.float32),
    )
  )


def update_program(
  config: ModelConfig,
  recipe: Recipe,
  devices,
  *,
  device: Device,
  rows: int,
  prompt_len: int,
  completion_len: int,
  mesh: str = "",
  update: Optional[UpdateConfig] = None,
  optimizer: OptimizerConfig = OptimizerConfig(),
  lora: Optional[LoraConfig] = None,
) -> Program:
  """One RL update (`jetrl.rl.update_step`: forward, log-probs, loss, backward, AdamW) on
  `rows` rows of prompt + completion tokens; on several devices with the project's mesh and
  partition rules (`--mesh`, jetrl.parallel), as a multi-device run compiles it. `lora`
  (rank > 0, one device): the update of a LoRA run, its adapters on a frozen base. `device`:
  what its plan is resolved for (`update_step(kernels=device)`)."""
  ucfg = update or UpdateConfig()
  params = abstract_params(config, jnp.float32)
  batch = _batch(rows, prompt_len, completion_len)
  kw = dict(
    model_config=config, cfg=ucfg, optimizer=optimizer, precision=recipe.train, kernels=device
  )
  if lora is not None and lora.enabled:
    if len(devices) != 1 or mesh:
      raise ValueError("a LoRA update compiles on one device (LoRA runs on one device)")
    state = jax.eval_shape(
      lambda p: init_lora_train_state(
        p,
        init_adapters(config, lora, jax.random.PRNGKey(0)),
        lora,
        recipe.train,
        ucfg,
        optimizer,
        device,
      ),
      params,
    )
    kw["lora"] = lora
  else:
    state = jax.eval_shape(lambda p: init_train_state(p, ucfg, optimizer), params)
  if len(devices) == 1 and not mesh:
    rep = one_device_sharding(devices)
    fn = jit_update_step()
    args = (_abstract(state, rep), _abstract(batch, rep), _sds((2,), jnp.uint32, rep))
  else:
    layout = make_layout(make_mesh(mesh, devices=devices), config, "train", recipe)
    fn = jit_update_step(out_shardings=(layout.tree_shardings(state), layout.replicated))
    kw["split_tokens"] = layout.token_split  # as parallel.sharded_update_step runs it
    args = (
      _abstract(state, layout.tree_shardings(state)),
      _abstract(batch, layout.batch_shardings(batch)),
      _sds((2,), jnp.uint32, layout.replicated),
    )
  return Program("update", fn, args, kw, tokens=rows * (prompt_len + completion_len), device=device)


def sft_program(
  config: ModelConfig,
  recipe: Recipe,
  devices,
  *,
  device: Device,
  rows: int,
  prompt_len: int,
  completion_len: int,
  optimizer: OptimizerConfig = OptimizerConfig(),
) -> Program:
  """One SFT step (`jetrl.train.sft.sft_step`) on one device, its plan resolved for `device`."""
  rep = one_device_sharding(devices)
  params = abstract_params(config, jnp.float32)
  opt_state = jax.eval_shape(lambda p: make_optimizer(optimizer, 1).init(p), params)
  batch = _batch(rows, prompt_len, completion_len)
  kw = dict(
    model_config=config,
    precision=recipe.train,
    optimizer=optimizer,
    total_steps=1000,
    kernels=device,
  )
  return Program(
    "sft",
    sft_step,
    (_abstract(params, rep), _abstract(opt_state, rep), _abstract(batch, rep)),
    kw,
    tokens=rows * (prompt_len + completion_len),
    device=device,
  )
