"""What a checkpoint's configuration must share with the run that resumes from it.

Flags outside a run's resumable list must match the checkpoint's, and the checkpoint must be
of the same kind of run (`jetrl.train.config.check_compatible`): a mismatch is a message
listing the flags that differ, before any array is read. The
number of steps may change, except where it shapes the learning-rate schedule (a cosine decay
over `--steps`, or a warmup longer than the run): resuming would then continue on a different
schedule than the one the checkpoint was trained on. That is refused, or, with
`--allow_schedule_change`, accepted and recorded in `<workdir>/config_changes.jsonl` (step,
old and new value), so the metrics can be read knowing where the schedule jumped
(docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import jax

from jetrl.config import FlagError
from jetrl.train.config import check_compatible

CHANGES_FILE = "config_changes.jsonl"


def resume_check(
  cfg: Any,
  directory: str,
  changes: list,
  *,
  schedule_of: Callable[[int], Any],
  schedule: str,
  resumable: tuple,
  kind: str,
) -> Callable[[dict], None]:
  """The check a checkpoint's metadata must pass before it is restored.

  `schedule_of(steps)` is what the learning-rate schedule depends on for a given `--steps`;
  when it differs between the checkpoint's steps and `cfg.steps`, the resume is refused unless
  `cfg.allow_schedule_change`, and then the change is put in `changes` (to be recorded once the
  checkpoint is restored).
  """

  def check(meta: dict) -> None:
    check_compatible(meta, cfg, directory, resumable, kind)
    saved = int(meta.get("config", {}).get("steps", cfg.steps))
    if schedule_of(saved) == schedule_of(cfg.steps):
      return
    if not cfg.allow_schedule_change:
      raise FlagError(
        "steps",
        f"the checkpoint in {directory} was written with "
        f"--steps={saved}, and the learning-rate schedule ({schedule}) depends on "
        f"it; rerun with --steps={saved}, or pass --allow_schedule_change to "
        "resume on the new schedule (the change is recorded)",
      )
    changes[:] = [{"field": "steps", "checkpoint": saved, "now": cfg.steps, "schedule": schedule}]

  return check


def record_changes(
  workdir: str, step: int, changes: list, log: Callable[[str], None] = print
) -> None:
  """Appends forced configuration changes to workdir/config_changes.jsonl, with a warning."""
  if not changes or jax.process_index() != 0:
    return
  with open(os.path.join(workdir, CHANGES_FILE), "a", encoding="utf-8") as f:
    for c in changes:
      f.write(json.dumps({"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **c}) + "\n")
      log(
        f"warning: resuming at step {step} with --{c['field']}={c['now']} (the checkpoint "
        f"had {c['checkpoint']}): the learning-rate schedule changes from here; recorded "
        f"in {CHANGES_FILE}"
      )
