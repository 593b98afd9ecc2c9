"""Metric writers: JSON lines (the source of truth), mirrored to the logging backends
(`jetrl.train.sinks`: TensorBoard, Weights & Biases, MLflow), and a console progress line.

A process killed while appending can leave a last line cut short. Readers drop such a torn
last line with a warning (the run that resumes writes that step again); a bad line anywhere
else is damage, not a kill, and is an error naming the file and line.

The console line's ETA is measured from the end of the first step a process runs: that step
compiles the sampler and the update, and counting it would predict the whole run at its pace
(146 s predicted for a run that took 30 s).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Callable, Optional

import numpy as np

from jetrl.train.run_files import append_text, refuse_link, write_atomic

# The backends moved to jetrl.train.sinks (one file each); their names stay importable here.
from jetrl.train.sinks import (  # noqa: F401
  SAMPLE_COLUMNS,
  WANDB_ID_FILE,
  Sinks,
  TensorBoard,
  WandB,
  import_wandb,
  sample_rows,
)


def _clean(d: dict) -> dict:
  out = {}
  for k, v in d.items():
    arr = np.asarray(v)
    if arr.ndim == 0:
      x = arr.item()
      out[k] = float(x) if isinstance(x, float) else x
    else:
      out[k] = arr.tolist()
  return out


class MetricWriter:
  """Appends one JSON object per record to `<workdir>/<name>.jsonl`; mirrors its finite
  scalars to `tensorboard` (a run's shared `TensorBoard`, or its `Sinks`: TensorBoard and W&B,
  if given) under `tag(key)`.

  `enabled=False` (every process of a multi-process run but the primary): nothing is written
  or truncated, so the file has one record per step however many processes run."""

  def __init__(
    self,
    workdir: str,
    name: str = "metrics",
    tensorboard: "Optional[TensorBoard | Sinks] | bool" = None,
    tag: Callable[[str], str] = lambda key: key,
    *,
    enabled: bool = True,
  ):
    os.makedirs(workdir, exist_ok=True)
    self.enabled = enabled
    self.path = os.path.join(workdir, f"{name}.jsonl")
    if isinstance(tensorboard, bool):  # True: a writer of its own under <workdir>/tb
      tensorboard = TensorBoard(workdir) if tensorboard else None
    self._tb = tensorboard
    self._tag = tag

  def truncate_after(self, step: int) -> None:
    """Drop records past `step` (written after the checkpoint a resumed run restarts from),
    and a torn last line."""
    if not self.enabled or not os.path.lexists(self.path):
      return
    refuse_link(self.path)
    keep = [json.dumps(r) + "\n" for r in read_jsonl(self.path) if r.get("step", -1) <= step]
    write_atomic(self.path, "".join(keep))

  def write(self, step: int, metrics: dict) -> dict:
    record = {"step": int(step), **_clean(metrics)}
    if not self.enabled:
      return record
    append_text(self.path, json.dumps(record) + "\n")
    if self._tb is not None:
      self._tb.scalars(
        step,
        {
          self._tag(k): v
          for k, v in record.items()
          if k != "step"
          and isinstance(v, (int, float))
          and not isinstance(v, bool)
          and math.isfinite(v)
        },
      )
    return record

  def write_many(self, records: list[dict]) -> None:
    """Appends records as they are (each with its own "step"), in one write."""
    if self.enabled and records:
      append_text(self.path, "".join(json.dumps(_clean(r)) + "\n" for r in records))

  def records(self) -> list[dict]:
    return read_jsonl(self.path) if os.path.exists(self.path) else []


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON-lines metrics file; a torn last line is dropped with a warning."""
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  records = []
  for k, (n, line) in enumerate(lines):
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    except ValueError as e:
      if k == len(lines) - 1:
        warnings.warn(
          f"{path}:{n}: dropping a torn last line ({e}): {line[:80]!r}",
          RuntimeWarning,
          stacklevel=2,
        )
        break
      raise ValueError(f"{path}:{n}: not a JSON record ({e}); the file is damaged") from None
    records.append(record)
  return records


class Progress:
  """One console line per step: step/total, key metrics, elapsed time and ETA.

  The ETA is the mean time per step since the end of this process's first step (which
  compiles) times the steps left; until a second step has run it says so instead."""

  def __init__(
    self,
    total: int,
    start: int = 0,
    stream=None,
    clock: Callable[[], float] = time.monotonic,
    write: Optional[Callable[[str], None]] = None,
  ):
    self.total, self.start = total, start
    self.clock = clock
    self.t0 = clock()
    self.first: Optional[tuple[int, float]] = None  # (step, time) at the end of the first step
    self.stream = stream or sys.stdout
    self.write = write  # a run's `log` (None: print to `stream`)

  def eta(self, step: int) -> Optional[float]:
    """Seconds left after `step`, or None while only the compiling step has run."""
    now = self.clock()
    if self.first is None:
      self.first = (step, now)
      return None
    first_step, t_first = self.first
    if step <= first_step:
      return None
    return (now - t_first) / (step - first_step) * (self.total - step)

  def update(self, step: int, fields: dict[str, float], extra: Optional[str] = None) -> None:
    eta = self.eta(step)
    elapsed = self.clock() - self.t0
    parts = " ".join(f"{k} {v:.3g}" for k, v in fields.items())
    bar_n = int(20 * step / max(self.total, 1))
    bar = "#" * bar_n + "." * (20 - bar_n)
    when = (
      "ETA at the next line (this one includes compilation)"
      if eta is None and step < self.total
      else f"ETA {eta or 0:.0f}s"
    )
    line = f"[{bar}] step {step}/{self.total} {parts} | {elapsed:.0f}s elapsed, {when}"
    if extra:
      line += f" | {extra}"
    if self.write is not None:
      self.write(line)
    else:
      print(line, file=self.stream, flush=True)
