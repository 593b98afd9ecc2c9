"""Checks of what a run's flags name on disk, made when the run starts, before anything is
compiled or written.

The values themselves are checked by the config classes when they are built
(`jetrl.config`); what is left needs the file system: a workdir that is a file, a remote
workdir this runner cannot write to, an `--init_from` folder without checkpoints, a model that
is neither a preset nor a directory. Each is a `FlagError` in the flag style
(`--workdir: ... is a file; give a directory`), never a traceback at step 1 or a run that
quietly trains nothing. See docs/reliability.md.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from jetrl.config import FlagError

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


def check_init_from(init_from: Optional[str]) -> None:
  """`--init_from` must be the workdir of an earlier run, holding at least one checkpoint."""
  if not init_from:
    return
  check_local("init_from", init_from)
  if not os.path.isdir(init_from):
    raise FlagError("init_from", f"{init_from!r} is not a directory")
  if not checkpoint_steps(init_from):
    raise FlagError(
      "init_from",
      f"no checkpoint under {os.path.join(init_from, 'checkpoints')}"
      "; give the --workdir of an earlier sft.py or train.py run",
    )


def check_model(name: str) -> None:
  """`--model.name` must be a preset or a directory (its files are checked when it loads)."""
  from jetrl.models import PRESETS  # pylint: disable=import-outside-toplevel

  if name in PRESETS:
    return
  check_local("model.name", name)
  if not os.path.isdir(name):
    raise FlagError(
      "model.name", f"{name!r} is neither a preset ({sorted(PRESETS)}) nor a directory"
    )
