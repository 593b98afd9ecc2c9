"""What a checkpoint's configuration must share with the run that resumes from it.

Fields not marked resumable on the field itself (`field(..., resumable=True)`, or a whole
node: `node(..., resumable=True)`; `jetrl.config.resumable_paths`) must match the
checkpoint's, and the checkpoint must be of the same kind of run (`check_compatible`): a
mismatch is a message listing the flags that differ, before any array is read. The
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

from jetrl.train.run_files import append_text
from jetrl.config import FlagError, flatten, leaf_paths, resumable_paths, upgrade
from jetrl.rl.optimizer import schedule_key

CHANGES_FILE = "config_changes.jsonl"


def _plain(value):
  """A value as it reads back from JSON (tuples are lists there)."""
  return json.loads(json.dumps(value))


def incompatible_fields(saved: dict, current) -> list[str]:
  """The fields whose values differ between a checkpoint's config (nested dict) and the
  current one, as `--path: checkpoint has x, this run has y` lines. A field the checkpoint
  does not record counts as its default (older checkpoints stay usable); one the current
  config does not have is a line of its own. A value an older version stored for what is now
  another value (`field(legacy=...)`: `sampling.top_k` 0 for none) compares as the new one."""
  resumable = resumable_paths(type(current))
  now = leaf_paths(current)
  defaults = leaf_paths(type(current)())
  saved = flatten(upgrade(type(current), saved))
  free = lambda path: any(path == r or path.startswith(r + ".") for r in resumable)
  lines = [
    f"--{k}: the checkpoint has this field ({saved[k]!r}), this version has no such field"
    for k in saved
    if k not in now and not free(k)
  ]
  for k, value in now.items():
    if free(k):
      continue
    old = saved.get(k, defaults[k])
    if _plain(old) != _plain(value):
      lines.append(f"--{k}: checkpoint has {old!r}, this run has {value!r}")
  return lines


def check_compatible(meta: dict, config, path: str, kind: str = "rl") -> None:
  """FlagError when a checkpoint was written by another kind of run or another
  configuration, naming the fields that differ."""
  found = meta.get("kind", "rl")
  if found != kind:
    names = {"rl": "an RL run (experiments/train.py)", "sft": "an SFT run (experiments/sft.py)"}
    hint = " pass it as --init_from to warm-start from it," if found == "sft" else ""
    raise FlagError(
      "workdir",
      f"{path} holds checkpoints of {names.get(found, found)}, not "
      f"of {names.get(kind, kind)};{hint} or use another --workdir",
    )
  diffs = incompatible_fields(meta.get("config", {}), config)
  if diffs:
    raise FlagError(
      None,
      f"the checkpoint in {path} was written with other settings; rerun "
      "with the same flags (or the run's config.json as --config), or use "
      "another --workdir. Differences:\n  " + "\n  ".join(diffs) + _old_logp_hint(meta),
    )


def _old_logp_hint(meta: dict) -> str:
  """The note for a checkpoint written when `update.old_logp` defaulted to 'rollout', or to
  'recompute'."""
  update = meta.get("config", {}).get("update", {})
  if update.get("old_logp") == "recompute":
    return (
      "\n(--update.old_logp defaults to 'auto' since the update of one epoch of one minibatch "
      "takes the old log-probs from its own forward; pass --update.old_logp=recompute to "
      "resume this run as it was)"
    )
  if update.get("old_logp") != "rollout":
    return ""
  if update.get("is_method", "none") != "none":
    return (
      "\n(this checkpoint was trained with --update.old_logp=rollout and "
      f"--update.is_method={update['is_method']}, which weighted the mismatch twice and is no "
      "longer accepted; start a new --workdir, from it with --init_from if you like)"
    )
  return (
    "\n(--update.old_logp defaults to 'recompute' since the PPO ratio's old policy became the "
    "pre-update training forward; pass --update.old_logp=rollout to resume this run as it was)"
  )


def resume_check(
  cfg: Any,
  directory: str,
  changes: list,
  *,
  kind: str,
) -> Callable[[dict], None]:
  """The check a checkpoint's metadata must pass before it is restored: `check_compatible`,
  then the learning-rate schedule.

  The schedule is `cfg.optimizer`'s over `cfg.schedule_steps(steps)` optimizer steps for a
  given `--steps`; when it differs between the checkpoint's steps and
  `cfg.steps`, the resume is refused unless `cfg.allow_schedule_change`, and then the change is
  put in `changes` (to be recorded once the checkpoint is restored).
  """
  o = cfg.optimizer
  schedule = f"--optimizer.schedule={o.schedule}, --optimizer.warmup_steps={o.warmup_steps}"

  def schedule_of(steps: int):
    return schedule_key(o, cfg.schedule_steps(steps))

  def check(meta: dict) -> None:
    check_compatible(meta, cfg, directory, kind)
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
  for c in changes:
    record = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **c}
    append_text(os.path.join(workdir, CHANGES_FILE), json.dumps(record) + "\n")
    log(
      f"warning: resuming at step {step} with --{c['field']}={c['now']} (the checkpoint "
      f"had {c['checkpoint']}): the learning-rate schedule changes from here; recorded "
      f"in {CHANGES_FILE}"
    )
