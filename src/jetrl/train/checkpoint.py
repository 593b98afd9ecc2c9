"""Orbax checkpoints: the train state, the run's position and its full config, verified.

A checkpoint is written to a temporary directory and renamed into place when complete, so a
run killed at any moment leaves either the previous checkpoint or the new one, never half of
one. Its metadata carries a checksum of every array (`jetrl.train.checksum`) and refuses to be
written with a NaN or Inf in it; the metadata itself (step, data position, config, the arrays'
checksums) carries a SHA-256 of the rest of it, so that everything a resume reads is checked.

`restore_latest` restores the newest checkpoint that is intact: one that fails to load, whose
arrays do not match their checksums, or that holds a non-finite value is moved aside to
`<workdir>/checkpoints_damaged/<step>` with a warning, and the next older one is tried. A
workdir with checkpoints but none intact is an error, never a silent restart from step 0.
A checkpoint whose metadata lacks its checksums, or names another step than its folder, is
damaged like one that does not match them. See docs/reliability.md.

Several processes: every process saves and restores its own shards (Orbax finalizes the
checkpoint from process 0 once all have written), the processes agree on whether a checkpoint
could be read before going on, and process 0 alone moves a damaged one aside. A checkpoint
restores in any number of processes (docs/scaling.md).
"""

from __future__ import annotations

import errno
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
from jetrl.models import load_pretrained
from jetrl.train import checksum
from jetrl.train.checksum import META_CHECKSUM, meta_digest, verify, verify_meta  # noqa: F401
from jetrl.train.run_files import own_dir
from jetrl.train.validation import FlagError, checkpoint_steps, is_hf_folder

DAMAGED_DIR = "checkpoints_damaged"


class CheckpointError(RuntimeError):
  """No intact checkpoint could be restored."""


class SaveError(CheckpointError):
  """A checkpoint could not be written (the disk is full, say); the earlier ones are intact."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _disk_full(e: BaseException) -> Optional[OSError]:
  """The OSError meaning "no space" (ENOSPC, EDQUOT, EFBIG) in `e`'s chain of causes, if any."""
  seen = set()
  todo = [e]
  while todo:
    x = todo.pop()
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
      return x
    todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
  return None


def _free_space(path: str) -> str:
  """What is free on the file system of `path` (or of the nearest parent that exists)."""
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return f"{shutil.disk_usage(path or '.').free / 2**20:.1f} MiB"
  except OSError:
    return "unknown space"


class Checkpointer:
  """Save / restore {state pytree, meta JSON} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, keep: int = 2, *, create: bool = True):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.keep = keep
    self.create = create
    self.restored: Optional[str] = None  # the folder `restore_latest` restored
    if create:  # a link planted as checkpoints/ would take the checkpoints elsewhere
      os.makedirs(self.workdir, exist_ok=True)
      own_dir(self.directory)
    self._mngr = self._manager()

  def _manager(self):
    return ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=self.keep,
        create=self.create,
        read_only=not self.create,  # a reader (export, --init_from) never saves or deletes
        enable_async_checkpointing=False,
      ),
    )

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Save `state` with `meta` (+ the arrays' checksums); refuses non-finite values."""
    bad = checksum.non_finite(state)
    if bad:
      raise ValueError(f"refusing to save checkpoint {step}: non-finite values in {bad[:4]}")
    meta = {"step": step, **meta}
    if meta["step"] != step:
      raise ValueError(f"checkpoint {step}: its metadata says step {meta['step']!r}")
    meta["checksums"] = checksum.tree_checksums(state)
    meta[META_CHECKSUM] = meta_digest(meta)
    own_dir(self.directory)  # still the run's own folder, not a link planted since
    try:
      self._mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      full = _disk_full(e)
      if full is None:
        raise
      raise SaveError(
        f"checkpoint {step} could not be written to {self.directory}: {full.strerror or full} "
        f"({_free_space(self.directory)} free there); the checkpoints before it are intact, "
        "free some space and rerun to resume"
      ) from None

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """Restore the state into the structure, dtypes and shardings of `target`, verified
    against its checksums (ValueError naming the arrays that differ or are not finite)."""
    abstract = jax.tree_util.tree_map(
      lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        if hasattr(x, "shape")
        else x
      ),
      target,
    )
    out = self._mngr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    meta = dict(out.meta)
    verify_meta(meta, f"{self.directory}/{step}", step)
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
      getattr(meta, "tree", meta),
      is_leaf=is_array,
    )
    return self._mngr.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    ).state

  def restore_meta(self, step: int) -> dict:
    """The checkpoint's metadata, verified against its own checksum (ValueError if it differs:
    a flipped `"step": 6` -> `7` would skip a step, `"data_pos"` shift the data)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = dict(out.meta)
    verify_meta(meta, f"{self.directory}/{step}", step)
    return meta

  def restore_latest(
    self,
    target: Any,
    check_meta: Callable[[dict], None] = lambda m: None,
    log: Callable[[str], None] = print,
  ) -> Optional[tuple[Any, dict]]:
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
        self.restored = os.path.join(self.directory, str(step))
        return restored
      failures.append((step, why or "unreadable in another process"))
      self._set_aside(step, failures[-1][1], log)
    if failures:
      raise CheckpointError(
        f"no intact checkpoint in {self.directory}; damaged ones were moved to "
        f"{os.path.join(self.workdir, DAMAGED_DIR)}:\n  "
        + "\n  ".join(f"step {s}: {why}" for s, why in failures)
      )
    return None

  def _set_aside(self, step: int, why: str, log: Callable[[str], None]) -> None:
    message = (
      f"checkpoint {self.directory}/{step} is damaged ({why[:300]}); moved to "
      f"{DAMAGED_DIR}/ and trying the one before it"
    )
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log(f"warning: {message}")
    if parallel.is_primary():
      dest = os.path.join(self.workdir, DAMAGED_DIR, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
      own_dir(os.path.dirname(dest))
      shutil.move(os.path.join(self.directory, str(step)), dest)
    parallel.barrier(f"jetrl:checkpoint-set-aside-{step}")  # moved before anyone looks again
    self._mngr.close()
    self._mngr = self._manager()  # forget the moved step

  def close(self):
    self._mngr.close()


def load_params_from(workdir: str, target_params: Any, log: Callable[[str], None] = print) -> Any:
  """The params of the newest intact checkpoint in `workdir` (a warm start), or the weights of
  a Hugging Face folder (one without checkpoints), cast like target.

  Nothing in `workdir` is changed: a damaged checkpoint is skipped with a warning. An SFT run
  that has not reached its last step is refused (its params are not the warm start it names).
  A Hugging Face folder's weights must have the target's shapes (its first layers are taken
  when it has more).
  """
  steps = checkpoint_steps(workdir)
  if not steps and is_hf_folder(workdir):
    return _hf_params(workdir, target_params, log)
  if not steps:
    raise FlagError(
      "init_from", f"no checkpoint found under {os.path.join(workdir, 'checkpoints')}"
    )
  params, meta = read_params(workdir, log=log)
  kind = meta.get("kind", "rl")
  if (meta.get("config", {}).get("lora") or {}).get("rank"):
    raise FlagError(
      "init_from",
      f"the run in {workdir} trained LoRA adapters, not the model's weights; export it "
      "merged (experiments/export_hf.py --workdir ... --out FOLDER) and warm-start from FOLDER",
    )
  total = meta.get("config", {}).get("steps")
  if kind == "sft" and total is not None and int(meta["step"]) < int(total):
    raise FlagError(
      "init_from",
      f"the SFT run in {workdir} stopped at step {meta['step']} of "
      f"{total}; rerun it to finish (it resumes) before warm-starting from it",
    )
  try:
    return jax.tree_util.tree_map(lambda t, p: np.asarray(p).astype(t.dtype), target_params, params)
  except ValueError as e:
    raise FlagError(
      "init_from",
      f"the {kind} checkpoint's params do not match this model "
      f"(--model.name / --model.n_layers / tokenizer): {e}",
    ) from None


def read_params(
  workdir: str,
  step: Optional[int] = None,
  *,
  flag: str = "init_from",
  log: Callable[[str], None] = print,
) -> tuple[Any, dict]:
  """(params as stored, meta) of checkpoint `step` of a run's workdir (None: the newest intact
  one; a damaged one is skipped with a warning), verified against their checksums; nothing in
  `workdir` is changed. FlagErrors name `flag` (a checkpoint given by step must be intact)."""
  ckpt = Checkpointer(workdir, create=False)
  problems = []
  try:
    steps = ckpt.steps()
    if step is not None:
      if step not in steps:
        raise FlagError("step", f"no checkpoint {step} under {ckpt.directory}; it has {steps}")
      steps = [step]
    for s in reversed(steps):
      try:
        meta = ckpt.restore_meta(s)
        # Structure from the checkpoint itself, every array whole on this process (a
        # checkpoint written by any number of processes).
        restored = ckpt.restore_local(s)
        # Only the params: without a target the optimizer state comes back as plain
        # containers, whose leaf paths differ from the saved ones.
        verify(restored["params"], meta, f"{ckpt.directory}/{s}", "['params']")
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"step {s}: {type(e).__name__}: {e}")
        message = f"--{flag}: checkpoint {ckpt.directory}/{s} is damaged ({e}); skipped"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log(f"warning: {message}")
        continue
      return restored["params"], meta
    raise FlagError(
      flag, f"no intact checkpoint under {ckpt.directory}:\n  " + "\n  ".join(problems)
    )
  finally:
    ckpt.close()


def _hf_params(path: str, target_params: Any, log: Callable[[str], None]) -> Any:
  """A Hugging Face folder's weights as a warm start for `target_params` (same shapes; the
  first layers when the folder has more)."""
  try:
    _, params = load_pretrained(path)
  except (OSError, ValueError) as e:
    raise FlagError("init_from", f"{path}: {e}") from None
  n = int(jax.tree_util.tree_leaves(target_params["layers"])[0].shape[0])
  have = int(jax.tree_util.tree_leaves(params["layers"])[0].shape[0])
  if have < n:
    raise FlagError("init_from", f"{path} has {have} layers; this model has {n}")
  params = dict(params, layers=jax.tree_util.tree_map(lambda a: a[:n], params["layers"]))
  want = jax.tree_util.tree_structure(target_params)
  if jax.tree_util.tree_structure(params) != want:
    raise FlagError(
      "init_from",
      f"the weights in {path} are not those of this model "
      "(--model.name / --model.n_layers): their tensors differ",
    )
  flat_t = jax.tree_util.tree_flatten_with_path(target_params)[0]
  for (where, t), p in zip(flat_t, jax.tree_util.tree_leaves(params)):
    if tuple(p.shape) != tuple(t.shape):
      raise FlagError(
        "init_from",
        f"the weights in {path} do not fit this model: "
        f"params{jax.tree_util.keystr(where)} is {tuple(p.shape)} there, "
        f"{tuple(t.shape)} here (--model.name / --model.n_layers / tokenizer)",
      )
  log(f"warm start from the weights in {path}")
  return jax.tree_util.tree_map(lambda t, p: np.asarray(p).astype(t.dtype), target_params, params)
