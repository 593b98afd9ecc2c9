"""Weights & Biases (`--logging.wandb`): offline by default, its files under <workdir>/wandb."""

from __future__ import annotations

import os
import secrets
import string
from typing import Optional

from jetrl.config import FlagError
from jetrl.train.run_files import refuse_link, write_atomic
from jetrl.train.sinks.base import SAMPLE_COLUMNS, Backend, sample_rows

WANDB_ID_FILE = "wandb_id"  # <workdir>/<prefix>wandb_id: the run's W&B id, kept for a resume
_ID_CHARS = string.ascii_lowercase + string.digits


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
    self.workdir, self.run_config = workdir, config
    self.project, self.mode = project, mode
    self.name = name or os.path.basename(os.path.normpath(workdir))
    self.id_path = os.path.join(workdir, id_file)
    self._wandb = import_wandb()
    self._run = None

  def where(self) -> str:
    folder = os.path.join(self.workdir, "wandb")
    if self.mode == "offline":
      return (
        f"W&B (offline): {folder}/offline-run-* (upload with: wandb sync {folder}/offline-run-*)"
      )
    return f"W&B ({self.mode}): project {self.project!r}, run {self.name!r}, files under {folder}"

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
        config=self.run_config,
        settings=self._wandb.Settings(console="off", silent=True),
      )
    return self._run

  def config(self, tree: dict) -> None:
    """The run's configuration: W&B's config, given when the run starts (and updated after)."""
    self.run_config = tree
    if self._run is not None:
      self._run.config.update(tree, allow_val_change=True)

  def scalars(self, step: int, values: dict[str, float]) -> None:
    if values:
      self._open().log(dict(values), step=step)

  def samples(self, step: int, records: list[dict]) -> None:
    table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(records))
    self._open().log({"samples": table}, step=step)

  def artifacts(self, paths: list[str]) -> None:
    """The PNG plots, as images under plots/<name> (at the run's last step)."""
    images = {
      "plots/" + os.path.splitext(os.path.basename(p))[0]: self._wandb.Image(p)
      for p in paths
      if p.endswith(".png") and os.path.isfile(p)
    }
    if images:
      self._open().log(images, commit=False)

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


def _open(cfg, prefix: str, start: int) -> WandB:
  del start
  return WandB(
    cfg.workdir,
    cfg.to_dict(),
    project=cfg.logging.wandb_project,
    name=cfg.logging.wandb_name,
    mode=cfg.logging.wandb_mode,
    id_file=prefix + WANDB_ID_FILE,
  )


BACKEND = Backend(
  "wandb", lambda logging: logging.wandb, _open, import_wandb, files=(WANDB_ID_FILE, "wandb")
)
