"""Checks of what a run's flags name on disk, made when the run starts, before anything is
compiled or written.

The values themselves are checked by the config classes when they are built
(`jetrl.config`); what is left needs the file system: a workdir that is a file, a remote
workdir this runner cannot write to, an `--init_from` folder without checkpoints, a model that
is none of a preset, a directory or a hub id in the cache. Each is a `FlagError` in the flag style
(`--workdir: ... is a file; give a directory`), never a traceback at step 1 or a run that
quietly trains nothing. See docs/reliability.md.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from jetrl.config import FlagError
from jetrl.data.user_reward import check_spec
from jetrl.models import PRESETS
from jetrl.models.io.hub import hub_folder, is_hub_id

_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def check_local(flag: str, path: str) -> None:
  """Remote paths (gs://, s3://, ...) are refused: metrics, the workdir lock and checkpoints
  are written with local file operations."""
  if _REMOTE.match(path):
    raise FlagError(
      flag,
      f"{path!r} is a remote path; this runner writes with local file "
      "operations (flock, rename, append), so give a local directory or a "
      "mounted one (gcsfuse, NFS) that every host sees",
    )


def check_workdir(workdir: Optional[str]) -> None:
  """A workdir is required, local, and must be (or become) a directory."""
  if not workdir:
    raise FlagError("workdir", "is required (where metrics and checkpoints go)")
  check_local("workdir", workdir)
  path = os.path.abspath(workdir)
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  if os.path.exists(path) and not os.path.isdir(path):
    where = "is a file" if path == os.path.abspath(workdir) else f"is inside a file ({path})"
    raise FlagError("workdir", f"{workdir!r} {where}; give a directory")


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints under `<workdir>/checkpoints`, oldest first (no I/O beyond
  listing the folder; a checkpoint still being written has a temporary name and is left
  out)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(
    int(n)
    for n in os.listdir(directory)
    if n.isdigit() and os.path.isdir(os.path.join(directory, n))
  )


def is_hf_folder(path: str) -> bool:
  """A Hugging Face model folder: config.json and safetensors weights (one file or an index)."""
  return os.path.isfile(os.path.join(path, "config.json")) and any(
    os.path.isfile(os.path.join(path, f))
    for f in ("model.safetensors", "model.safetensors.index.json")
  )


def check_init_from(init_from: Optional[str]) -> None:
  """`--init_from` must be the workdir of an earlier run, holding at least one checkpoint, or
  a Hugging Face folder."""
  if not init_from:
    return
  check_local("init_from", init_from)
  if not os.path.isdir(init_from):
    raise FlagError("init_from", f"{init_from!r} is not a directory")
  if not checkpoint_steps(init_from) and not is_hf_folder(init_from):
    raise FlagError(
      "init_from",
      f"no checkpoint under {os.path.join(init_from, 'checkpoints')} and no Hugging Face "
      "weights (config.json + model.safetensors) in it; give the --workdir of an earlier "
      "sft.py or train.py run, or a Hugging Face folder",
    )


def preset_list() -> str:
  """The presets, said to be random weights (for help and error texts)."""
  return (
    f"presets {', '.join(sorted(PRESETS))} (RANDOM weights in the shape of the model they "
    "name, not trained ones)"
  )


def check_model(name: str, tokenizer: Optional[str] = None) -> None:
  """`--model.name` must be a preset, a directory or a hub id (`org/name`: in the local hub
  cache, or downloaded there), `--model.tokenizer` a directory (their files are checked when
  they load)."""
  if name.lower() not in PRESETS:
    check_local("model.name", name)
    if is_hub_id(name):
      try:
        hub_folder(name)
      except ValueError as e:
        raise FlagError("model.name", str(e)) from None
    elif not os.path.isdir(name):
      raise FlagError(
        "model.name",
        f"{name!r} is none of the {preset_list()}, a model folder, or a Hugging Face hub id "
        "(org/name)",
      )
  if tokenizer is not None:
    check_local("model.tokenizer", tokenizer)
    if not os.path.isdir(tokenizer):
      raise FlagError("model.tokenizer", f"{tokenizer!r} is not a directory")
    if not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
      raise FlagError(
        "model.tokenizer",
        f"no tokenizer.json in {tokenizer!r} (a fast tokenizer file is required)",
      )


def check_reward(spec: Optional[str]) -> None:
  """`--task.reward` names an existing file (a module is looked up when the reward loads)."""
  if spec is None:
    return
  try:
    check_spec(spec)
  except ValueError as e:
    raise FlagError("task.reward", str(e)) from None
