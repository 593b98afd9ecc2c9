"""Metric writers: JSON lines (the source of truth), TensorBoard, Weights & Biases, and a
console progress line.

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
import secrets
import string
import sys
import time
import warnings
from typing import Callable, Optional

import numpy as np

from jetrl.config import FlagError
from jetrl.train.run_files import append_text, own_dir, refuse_link, write_atomic


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


class TensorBoard:
  """One TensorBoard event writer for a run (under <workdir>/tb), shared by its metric
  writers; created on first use, as a new event file.

  purge_step: a resumed run's first step (the restored checkpoint's + 1). The file then starts
  with a session start at that step, which makes TensorBoard drop the earlier files' events at
  that step and past (those the interrupted run wrote after its checkpoint, which this run
  writes again), so every step shows one point. Event files are named so that a later writer's
  sorts after an earlier one's (TensorBoard reads them in name order) and never replaces it,
  even within one second."""

  def __init__(self, workdir: str, purge_step: Optional[int] = None):
    self.directory = os.path.join(workdir, "tb")
    self.purge_step = purge_step
    self._writer = None

  def _open(self):
    if self._writer is None:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

      own_dir(self.directory)  # never a link's target
      self._writer = SummaryWriter(
        self.directory, purge_step=self.purge_step, filename_suffix=f".{time.time_ns():020d}"
      )
    return self._writer

  def scalars(self, step: int, values: dict[str, float]) -> None:
    writer = self._open()
    for tag, v in values.items():
      writer.add_scalar(tag, v, step)
    writer.flush()

  def samples(self, step: int, records: list[dict]) -> None:
    """The step's samples as a markdown table under the "samples" text tag."""
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
    for row in sample_rows(records):
      cells = (str(v).replace("|", "\\|").replace("\n", "<br>") for v in row)
      lines.append("| " + " | ".join(cells) + " |")
    writer = self._open()
    writer.add_text("samples", "\n".join(lines), step)
    writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


# The columns of the samples table (TensorBoard's text, W&B's table): a samples.jsonl record's
# fields but its token ids.
SAMPLE_COLUMNS = ("step", "row", "prompt", "completion", "answer", "reward", "length")
WANDB_ID_FILE = "wandb_id"  # <workdir>/<prefix>wandb_id: the run's W&B id, kept for a resume
_ID_CHARS = string.ascii_lowercase + string.digits


def sample_rows(records: list[dict]) -> list[list]:
  return [[r.get(c) for c in SAMPLE_COLUMNS] for r in records]


def import_wandb():
  """The wandb module, or a one-line FlagError saying how to install it (`--logging.wandb` is
  checked so when a run starts: `jetrl.train.driver.run_guarded`)."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise FlagError(
      "logging.wandb",
      f"needs the wandb package ({e}): pip install wandb, or pip install 'jetrl[wandb]'",
    ) from None
  return wandb


class WandB:
  """The Weights & Biases run of a workdir, beside its TensorBoard (the same `scalars` and
  `samples`), with `config` (the run's configuration) as its config; started on first use, its
  files under <workdir>/wandb.

  The run's id is kept in <workdir>/<id_file> (written atomically), and a resumed jetrl run
  continues that W&B run (`resume="allow"`). A resumed jetrl run redoes the steps the
  interrupted one ran past its last checkpoint, with the same values (it resumes bit-exactly;
  only the time/* measurements differ). W&B needs increasing steps and drops a step at or
  before the last it holds with a warning: those repeated steps are the ones dropped, and that
  loses nothing. Offline (the default), each process writes an offline-run-* folder of its
  own under <workdir>/wandb with the run's id (a resumed one holds the redone steps again, with
  the same values); `wandb sync <workdir>/wandb/offline-run-*` uploads them."""

  def __init__(
    self,
    workdir: str,
    config: dict,
    *,
    project: str = "jetrl",
    name: Optional[str] = None,
    mode: str = "offline",
    id_file: str = WANDB_ID_FILE,
  ):
    self.workdir, self.config = workdir, config
    self.project, self.mode = project, mode
    self.name = name or os.path.basename(os.path.normpath(workdir))
    self.id_path = os.path.join(workdir, id_file)
    self._wandb = import_wandb()
    self._run = None

  def run_id(self) -> str:
    """The workdir's W&B run id: the one kept there, else a new one, kept."""
    if os.path.lexists(self.id_path):
      refuse_link(self.id_path)
      with open(self.id_path, encoding="utf-8", errors="replace") as f:
        run_id = f.read(200).strip()
      if run_id:
        if not (len(run_id) <= 64 and all(c in _ID_CHARS for c in run_id)):
          raise ValueError(
            f"{self.id_path}: not a W&B run id ({run_id[:40]!r}); it holds lowercase letters "
            "and digits (delete the file to start a new W&B run)"
          )
        return run_id
    run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    write_atomic(self.id_path, run_id + "\n")
    return run_id

  def _open(self):
    if self._run is None:
      self._run = self._wandb.init(
        project=self.project,
        name=self.name,
        id=self.run_id(),
        resume="allow",
        dir=self.workdir,
        mode=self.mode,
        config=self.config,
        settings=self._wandb.Settings(console="off", silent=True),
      )
    return self._run

  def scalars(self, step: int, values: dict[str, float]) -> None:
    if values:
      self._open().log(dict(values), step=step)

  def samples(self, step: int, records: list[dict]) -> None:
    table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(records))
    self._open().log({"samples": table}, step=step)

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


class Sinks:
  """Several sinks (`TensorBoard`, `WandB`) as one: each call goes to every one of them."""

  def __init__(self, *sinks):
    self.sinks = [s for s in sinks if s is not None]

  def __bool__(self) -> bool:
    return bool(self.sinks)

  def scalars(self, step: int, values: dict[str, float]) -> None:
    for s in self.sinks:
      s.scalars(step, values)

  def samples(self, step: int, records: list[dict]) -> None:
    for s in self.sinks:
      s.samples(step, records)

  def close(self) -> None:
    """Closes every sink, even when one fails (the first error raised after)."""
    error = None
    for s in self.sinks:
      try:
        s.close()
      except Exception as e:  # pylint: disable=broad-except
        error = error or e
    if error is not None:
      raise error


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
