"""Logging backends, one file each behind the `Sink` protocol (`base.py`), and `Sinks`, the
fan-out a run's metric writers and hooks call.

Adding a backend is one new file here (a sink class and its `BACKEND = Backend(...)`: its
`LoggingConfig` switch, how it opens, the check of its package, its workdir files) and one
line in `BACKENDS` below; its flags are fields of `jetrl.train.nodes.LoggingConfig`.
"""

from __future__ import annotations

from jetrl.train.sinks import mlflow, tensorboard, wandb
from jetrl.train.sinks.base import SAMPLE_COLUMNS, Backend, Sink, sample_rows
from jetrl.train.sinks.mlflow import MLflow, import_mlflow
from jetrl.train.sinks.tensorboard import TensorBoard
from jetrl.train.sinks.wandb import WANDB_ID_FILE, WandB, import_wandb

# The backends a run can turn on, in the order they are written to.
BACKENDS: tuple[Backend, ...] = (tensorboard.BACKEND, wandb.BACKEND, mlflow.BACKEND)


class Sinks:
  """Several sinks as one: each call goes to every one of them (`config`, `artifacts` and
  `where` to those that have them)."""

  def __init__(self, *sinks):
    self.sinks = [s for s in sinks if s is not None]

  def __bool__(self) -> bool:
    return bool(self.sinks)

  def _each(self, method: str, *args) -> None:
    for s in self.sinks:
      fn = getattr(s, method, None)
      if fn is not None:
        fn(*args)

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self._each("scalars", step, values)

  def samples(self, step: int, records: list[dict]) -> None:
    self._each("samples", step, records)

  def config(self, tree: dict) -> None:
    self._each("config", tree)

  def artifacts(self, paths: list[str]) -> None:
    self._each("artifacts", paths)

  def where(self) -> list[str]:
    """One line per sink: where it writes and how to look."""
    return [s.where() for s in self.sinks if hasattr(s, "where")]

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


def check_packages(logging) -> None:
  """A one-line FlagError when a backend `logging` turns on misses its package."""
  for b in BACKENDS:
    if b.check is not None and b.on(logging):
      b.check()


def open_sinks(cfg, prefix: str = "", start: int = 0) -> list:
  """The sinks `cfg.logging` turns on (call on the primary process only)."""
  return [b.open(cfg, prefix, start) for b in BACKENDS if b.on(cfg.logging)]


def workdir_files(prefix: str = "") -> tuple[str, ...]:
  """The backends' files in a workdir (the id files with the run kind's prefix)."""
  out = []
  for b in BACKENDS:
    out += [prefix + f if f.endswith("_id") else f for f in b.files]
  return tuple(out)


__all__ = [
  "BACKENDS",
  "Backend",
  "MLflow",
  "SAMPLE_COLUMNS",
  "Sink",
  "Sinks",
  "TensorBoard",
  "WANDB_ID_FILE",
  "WandB",
  "check_packages",
  "import_mlflow",
  "import_wandb",
  "open_sinks",
  "sample_rows",
  "workdir_files",
]
