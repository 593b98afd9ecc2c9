"""Orbax checkpoints: the train state, the run's position and its full config, verified.

A checkpoint is written to a temporary directory and renamed into place when complete, so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of
one. Its metadata carries a checksum of every array (`jetrl.train.checksum`) and refuses to be
written with a NaN or Inf in it.

`restore_latest` restores the newest checkpoint that is intact: one that fails to load, whose
arrays do not match their checksums, or that holds a non-finite value is moved aside to
`<workdir>/checkpoints_damaged/<step>` with a warning, and the next older one is tried. A
workdir with checkpoints but none intact is an error, never a silent restart from step 0.
See docs/reliability.md.

Several processes: every process saves and restores its own shards (Orbax finalizes the
checkpoint from process 0 once all have written), the processes agree on whether a checkpoint
could be read before going on, and process 0 alone moves a damaged one aside. A checkpoint
restores in any number of processes (docs/scaling.md).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jetrl import parallel
from jetrl.train import checksum
from jetrl.train.validation import FlagError, checkpoint_steps

DAMAGED_DIR = "checkpoints_damaged"


class CheckpointError(RuntimeError):
  """No intact checkpoint could be restored."""


class Checkpointer:
  """Save / restore {state pytree, meta JSON} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, keep: int = 2, *, create: bool = True):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.keep = keep
    self.create = create
    self._mngr = self._manager()

  def _manager(self):
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=self.create,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Save `state` with `meta` (+ the arrays' checksums); refuses non-finite values."""
    bad = checksum.non_finite(state)
    if bad:
      raise ValueError(f"refusing to save checkpoint {step}: non-finite values in {bad[:4]}")
    meta = dict(meta, checksums=checksum.tree_checksums(state))
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)), force=True)
    self._mngr.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """Restore the state into the structure, dtypes and shardings of `target`, verified
    against its checksums (ValueError naming the arrays that differ or are not finite)."""
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        if hasattr(x, "shape") else x, target)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    meta = dict(out.meta)
    verify(out.state, meta, f"{self.directory}/{step}")
    return out.state, meta

  def restore_local(self, step: int) -> Any:
    """The saved state as the checkpoint itself describes it, every array whole on this
    process's first device, whatever the number of processes and devices that wrote it (a
    warm start's params; checksums are not verified here)."""
    path = os.path.join(self.directory, str(step), "state")
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    is_array = lambda m: hasattr(m, "shape") and hasattr(m, "dtype")
    abstract = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device) if is_array(m) else m,
        getattr(meta, "tree", meta), is_leaf=is_array)
    return self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract))).state

  def restore_meta(self, step: int) -> dict:
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out.meta)

  def restore_latest(self, target: Any, check_meta: Callable[[dict], None] = lambda m: None,
                     log: Callable[[str], None] = print) -> Optional[tuple[Any, dict]]:
    """(state, meta) of the newest intact checkpoint, or None when there is none at all.

    `check_meta(meta)` runs before the arrays are read (a configuration check); what it raises
    propagates. A damaged checkpoint is moved aside with a warning and the next older one is
    tried; when every checkpoint is damaged, CheckpointError lists them.
    """
    failures = []
    for step in reversed(self.steps()):
      # Every process reads the checkpoint (its own shards); they agree on the outcome, so a
      # read that fails in one process only sets the checkpoint aside in all of them.
      meta, why = None, None
      try:
        meta = self.restore_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        why = f"metadata unreadable ({type(e).__name__}: {e})"
      if not parallel.all_true(why is None):
        failures.append((step, why or "metadata unreadable in another process"))
        self._set_aside(step, failures[-1][1], log)
        continue
      check_meta(meta)
      try:
        restored = self.restore(step, target)
      except Exception as e:  # pylint: disable=broad-except
        restored, why = None, f"{type(e).__name__}: {e}"
      if parallel.all_true(restored is not None):
        return restored
      failures.append((step, why or "unreadable in another process"))
      self._set_aside(step, failures[-1][1], log)
    if failures:
      raise CheckpointError(
          f"no intact checkpoint in {self.directory}; damaged ones were moved to "
          f"{os.path.join(self.workdir, DAMAGED_DIR)}:\n  " +
          "\n  ".join(f"step {s}: {why}" for s, why in failures))
    return None

  def _set_aside(self, step: int, why: str, log: Callable[[str], None]) -> None:
    message = (f"checkpoint {self.directory}/{step} is damaged ({why[:300]}); moved to "
               f"{DAMAGED_DIR}/ and trying the one before it")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log(f"warning: {message}")
    if parallel.is_primary():
      dest = os.path.join(self.workdir, DAMAGED_DIR, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), dest)
    parallel.barrier(f"jetrl:checkpoint-set-aside-{step}")  # moved before anyone looks again
    self._mngr.close()
    self._mngr = self._manager()  # forget the moved step

  def close(self):
    self._mngr.close()


def verify(state: Any, meta: dict, where: str, prefix: str = "") -> None:
  """ValueError unless `state` (the subtree at `prefix`, when given) matches the checksums in
  `meta` and is finite."""
  saved = meta.get("checksums")
  if saved is not None:
    wrong = checksum.mismatches(saved, state, prefix)
    if wrong:
      raise ValueError(f"{where}: {len(wrong)} arrays do not match their checksums: "
                       f"{wrong[:4]}{' ...' if len(wrong) > 4 else ''}")
  bad = checksum.non_finite(state)
  if bad:
    raise ValueError(f"{where}: non-finite values (NaN or Inf) in {bad[:4]}")


def load_params_from(workdir: str, target_params: Any, log: Callable[[str], None] = print) -> Any:
  """The params of the newest intact checkpoint in `workdir` (a warm start), cast like target.

  Nothing in `workdir` is changed: a damaged checkpoint is skipped with a warning. An SFT run
  that has not reached its last step is refused (its params are not the warm start it names).
  """
  steps = checkpoint_steps(workdir)
  if not steps:
    raise FlagError("init_from",
                    f"no checkpoint found under {os.path.join(workdir, 'checkpoints')}")
  ckpt = Checkpointer(workdir, create=False)
  problems = []
  try:
    for step in reversed(ckpt.steps()):
      try:
        meta = ckpt.restore_meta(step)
        restored = ckpt.restore_local(step)
        # Only the params: without a target the optimizer state comes back as plain
        # containers, whose leaf paths differ from the saved ones.
        verify(restored["params"], meta, f"{ckpt.directory}/{step}", "['params']")
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"step {step}: {type(e).__name__}: {e}")
        message = f"--init_from: checkpoint {ckpt.directory}/{step} is damaged ({e}); skipped"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log(f"warning: {message}")
        continue
      break
    else:
      raise FlagError("init_from", f"no intact checkpoint under {ckpt.directory}:\n  " +
                      "\n  ".join(problems))
  finally:
    ckpt.close()
  kind = meta.get("kind", "rl")
  total = meta.get("config", {}).get("steps")
  if kind == "sft" and total is not None and int(meta["step"]) < int(total):
    raise FlagError("init_from", f"the SFT run in {workdir} stopped at step {meta['step']} of "
                    f"{total}; rerun it to finish (it resumes) before warm-starting from it")
  params = restored["params"]
  try:
    return jax.tree_util.tree_map(lambda t, p: np.asarray(p).astype(t.dtype), target_params, params)
  except ValueError as e:
    raise FlagError("init_from", f"the {kind} checkpoint's params do not match this model "
                    f"(--model.name / --model.n_layers / tokenizer): {e}") from None
