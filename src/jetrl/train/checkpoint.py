"""Orbax checkpoints: the train state, the run's position and its full config.

A checkpoint is written to a temporary directory and renamed into place when complete, so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of
one. Rerunning the same command restores the latest complete checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jetrl.train.config import incompatible_fields


class Checkpointer:
  """Save / restore {state pytree, meta JSON} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)), force=True)
    self._mngr.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """Restore the state into the structure, dtypes and shardings of `target`."""
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        if hasattr(x, "shape") else x, target)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, dict(out.meta)

  def restore_meta(self, step: int) -> dict:
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out.meta)

  def close(self):
    self._mngr.close()


def check_compatible(meta: dict, config, path: str) -> None:
  """Refuse a checkpoint written under a different configuration, naming the fields."""
  diffs = incompatible_fields(meta.get("config", {}), config)
  if diffs:
    raise ValueError(
        f"checkpoint in {path} was written by an incompatible configuration; use another "
        f"--workdir or the same flags. Differences:\n  " + "\n  ".join(diffs))


def load_params_from(workdir: str, target_params: Any) -> Any:
  """The params of the latest checkpoint in `workdir` (a warm start), cast like target."""
  ckpt = Checkpointer(workdir)
  step = ckpt.latest_step()
  if step is None:
    raise ValueError(f"--init_from: no checkpoint found under {ckpt.directory}")
  meta = ckpt.restore_meta(step)
  kind = meta.get("kind", "rl")
  restored = ckpt._mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))  # structure from the checkpoint itself
  ckpt.close()
  params = restored.state["params"]
  try:
    return jax.tree_util.tree_map(lambda t, p: np.asarray(p).astype(t.dtype), target_params, params)
  except ValueError as e:
    raise ValueError(f"--init_from: the {kind} checkpoint's params do not match this model "
                     f"(--model / --n_layers / tokenizer): {e}") from None
