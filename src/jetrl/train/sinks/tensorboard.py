"""TensorBoard (`--logging.tensorboard`): event files under <workdir>/tb."""

from __future__ import annotations

import os
import time
from typing import Optional

from jetrl.train.run_files import own_dir
from jetrl.train.sinks.base import SAMPLE_COLUMNS, Backend, sample_rows


class TensorBoard:
  """One TensorBoard event writer for a run (under <workdir>/tb), shared by its metric
  writers; created on first use, as a new event file.

  purge_step: a resumed run's first step (the restored checkpoint's + 1). The file then starts
  with a session start at that step, which makes TensorBoard drop the earlier files' events at
  that step and past (those the interrupted run wrote after its checkpoint, which this run
  writes again: scalars and the completions text alike), so every step shows one point and
  one table. Event files are named so that a later writer's sorts after an earlier one's
  (TensorBoard reads them in name order) and never replaces it, even within one second."""

  def __init__(self, workdir: str, purge_step: Optional[int] = None):
    self.directory = os.path.join(workdir, "tb")
    self.purge_step = purge_step
    self._writer = None
    self._samples_logged: set[int] = set()

  def _open(self):
    if self._writer is None:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

      own_dir(self.directory)  # never a link's target
      self._writer = SummaryWriter(
        self.directory, purge_step=self.purge_step, filename_suffix=f".{time.time_ns():020d}"
      )
    return self._writer

  def where(self) -> str:
    return f"TensorBoard: {self.directory} (tensorboard --logdir {self.directory})"

  def scalars(self, step: int, values: dict[str, float]) -> None:
    writer = self._open()
    for tag, v in values.items():
      writer.add_scalar(tag, v, step)
    writer.flush()

  def samples(self, step: int, records: list[dict]) -> None:
    """The step's samples as a markdown table under the "samples" text tag, once a step."""
    if step in self._samples_logged:
      return
    self._samples_logged.add(step)
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
    for row in sample_rows(records):
      cells = (_cell(v).replace("|", "\\|").replace("\n", "<br>") for v in row)
      lines.append("| " + " | ".join(cells) + " |")
    writer = self._open()
    writer.add_text("samples", "\n".join(lines), step)
    writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _cell(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def _open(cfg, prefix: str, start: int) -> TensorBoard:
  del prefix
  return TensorBoard(cfg.workdir, purge_step=start + 1 if start else None)


BACKEND = Backend("tensorboard", lambda logging: logging.tensorboard, _open, files=("tb",))
