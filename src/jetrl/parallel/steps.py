"""Running the sampler and the update on a mesh: explicit out shardings, layout switches,
and moving results to the host on one or several hosts."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jetrl.parallel.rules import Layout
from jetrl.rl.update import jit_update_step


def sharded_update_step(layout: Layout) -> Callable:
  """`jetrl.rl.update_step` compiled with explicit out shardings on `layout`'s mesh.

  The new TrainState comes back in exactly the shardings of the state passed in (so the
  donated buffers are reused and the layout never drifts step to step) and the metrics come
  back replicated. Inside the step each layer's activations keep their rows where the batch's
  rows are (`layout.token_split`). Same signature as `update_step`; pass a state placed with
  `layout.shard_state` and a batch placed with `layout.shard_batch`. `step.lower(...)` gives
  the lowered program (its compiled cost, its HLO).
  """
  cache = {}

  def jitted(state):
    sig = jax.tree_util.tree_structure(state)
    if sig not in cache:
      cache[sig] = jit_update_step(out_shardings=(layout.tree_shardings(state), layout.replicated))
    return cache[sig]

  def step(state, batch, key, **kw):
    return jitted(state)(state, batch, key, split_tokens=layout.token_split, **kw)

  def lower(state, batch, key, **kw):
    """The step's `jax.stages.Lowered` for these arguments (what `step` compiles)."""
    return jitted(state).lower(state, batch, key, split_tokens=layout.token_split, **kw)

  step.lower = lower
  return step


def switch_layout(params, src: Layout, dst: Layout, log: Callable[[str], None] | None = None):
  """`params` (placed on `src`) re-placed on `dst` with `jax.device_put`, device to device.

  Returns (params, seconds). The same pytree and dtypes; only the shardings change. When the
  two layouts place the params identically, nothing moves (0 seconds).
  """
  if src.same_params_layout(dst):
    return params, 0.0
  t0 = time.time()
  out = jax.device_put(params, dst.param_shardings)
  jax.block_until_ready(out)
  dt = time.time() - t0
  if log is not None:
    log(f"  params {src.mode} -> {dst.mode} layout: {dt * 1e3:.1f} ms")
  return out, dt


def to_host(tree) -> Any:
  """numpy copies of a pytree's arrays; on several hosts, arrays not fully addressable here
  are all-gathered first (every process gets the global value)."""

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  return jax.tree_util.tree_map(one, tree)
