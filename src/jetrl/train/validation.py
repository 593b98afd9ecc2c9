"""Checks of flag values that the run configurations share, each naming the flag at fault.

Every check runs before anything is compiled or written: a NaN learning rate, a seed JAX
would silently truncate, a synthetic-task knob out of range, a workdir that is a file or an
`--init_from` folder without checkpoints is a `FlagError` with a message in the flag style
(`--lr: must be a finite number in (0, 1], got nan`), never a traceback at step 1 or a run
that quietly trains nothing. See docs/reliability.md.
"""

from __future__ import annotations

import math
import os
from typing import Any

INT_MAX = 2 ** 31 - 1   # counts are int32 inside jitted code
SEED_MAX = 2 ** 32 - 1  # a JAX key holds 32 bits of seed: larger seeds would collide


class FlagError(ValueError):
  """An invalid flag value, or one this machine cannot run; the message names the flag
  (`flag=None`: the message names the flags itself)."""

  def __init__(self, flag: str | None, message: str):
    super().__init__(message if flag is None else f"--{flag}: {message}")
    self.flag = flag


def check_float(flag: str, value: Any, lo: float, hi: float, *, lo_open: bool = False,
                also: tuple = ()) -> float:
  """`value` if it is a finite number in [lo, hi] (or (lo, hi]), or one of `also`."""
  if value in also and not isinstance(value, bool):
    return value
  interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
  extra = f" or {', '.join(repr(a) for a in also)}" if also else ""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise FlagError(flag, f"must be a finite number in {interval}{extra}, got {value!r}")
  if not ((lo < value) if lo_open else (lo <= value)) or value > hi:
    raise FlagError(flag, f"must be in {interval}{extra}, got {value!r}")
  return value


def check_int(flag: str, value: Any, lo: int, hi: int = INT_MAX) -> int:
  """`value` if it is an int in [lo, hi]."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise FlagError(flag, f"must be an integer in [{lo}, {hi}], got {value!r}")
  if not lo <= value <= hi:
    raise FlagError(flag, f"must be in [{lo}, {hi}], got {value}")
  return value


def check_task_knobs(task: str, difficulty: int, length: int) -> None:
  """A synthetic task's difficulty and length within the task's own ranges."""
  from jetrl.data import SYNTHETIC_TASKS  # pylint: disable=import-outside-toplevel
  from jetrl.data.registry import task_class  # pylint: disable=import-outside-toplevel
  if task not in SYNTHETIC_TASKS:
    return
  cls = task_class(task)
  check_int("difficulty", difficulty, *cls.difficulty_range)
  check_int("length", length, *cls.length_range)


def check_workdir(workdir: str) -> None:
  """A workdir is required, and it must be (or become) a directory."""
  if not workdir:
    raise FlagError("workdir", "is required (where metrics and checkpoints go)")
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
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def check_init_from(init_from: str) -> None:
  """`--init_from` must be the workdir of an earlier run, holding at least one checkpoint."""
  if not init_from:
    return
  if not os.path.isdir(init_from):
    raise FlagError("init_from", f"{init_from!r} is not a directory")
  if not checkpoint_steps(init_from):
    raise FlagError("init_from", f"no checkpoint under {os.path.join(init_from, 'checkpoints')}"
                    "; give the --workdir of an earlier sft.py or train.py run")
