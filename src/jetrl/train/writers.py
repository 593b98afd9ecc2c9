"""Metric writers: JSON lines (the source of truth), TensorBoard, and a console progress line.

A process killed while appending can leave a last line cut short. Readers drop such a torn
last line with a warning (the run that resumes writes that step again); a bad line anywhere
else is damage, not a kill, and is an error naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Optional

import numpy as np


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
  """Appends one JSON object per record to `<workdir>/<name>.jsonl`; mirrors scalars to TB."""

  def __init__(self, workdir: str, name: str = "metrics", tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, f"{name}.jsonl")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def truncate_after(self, step: int) -> None:
    """Drop records past `step` (written after the checkpoint a resumed run restarts from),
    and a torn last line."""
    if not os.path.exists(self.path):
      return
    keep = [json.dumps(r) + "\n" for r in read_jsonl(self.path) if r.get("step", -1) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)

  def write(self, step: int, metrics: dict) -> dict:
    record = {"step": int(step), **_clean(metrics)}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    return record

  def close(self):
    if self._tb is not None:
      self._tb.close()


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
        warnings.warn(f"{path}:{n}: dropping a torn last line ({e}): {line[:80]!r}",
                      RuntimeWarning, stacklevel=2)
        break
      raise ValueError(f"{path}:{n}: not a JSON record ({e}); the file is damaged") from None
    records.append(record)
  return records


class Progress:
  """One console line per step: step/total, key metrics, elapsed and ETA."""

  def __init__(self, total: int, start: int = 0, stream=None):
    self.total, self.start = total, start
    self.t0 = time.time()
    self.stream = stream or sys.stdout

  def update(self, step: int, fields: dict[str, float], extra: Optional[str] = None) -> None:
    done = step - self.start
    elapsed = time.time() - self.t0
    eta = elapsed / max(done, 1) * (self.total - step)
    parts = " ".join(f"{k} {v:.3g}" for k, v in fields.items())
    bar_n = int(20 * step / max(self.total, 1))
    bar = "#" * bar_n + "." * (20 - bar_n)
    line = (f"[{bar}] step {step}/{self.total} {parts} | {elapsed:.0f}s elapsed, "
            f"ETA {eta:.0f}s")
    if extra:
      line += f" | {extra}"
    print(line, file=self.stream, flush=True)
