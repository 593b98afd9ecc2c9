"""MLflow (`--logging.mlflow`): a file store under <workdir>/mlruns by default, or the tracking
server or store `--logging.mlflow_uri` names.

What it holds: every finite scalar the JSON lines get, at its step (metrics.jsonl's under
their own names, eval.jsonl's as eval/*), named by `metric_name`; the run's configuration as
params (flattened: `logging.every`, ...) and as the artifact config.json; the completions
table of each logged step as the artifact samples/step_<step>.json (MLflow's table format:
{"columns": [...], "data": [[...], ...]}); the PNG plots as artifacts under plots/.

A resumed jetrl run continues the same MLflow run: its id is kept in
<workdir>/<prefix>mlflow_run_id. MLflow keeps every value logged, a repeated step too, so the
steps a resumed run redoes (those the interrupted run wrote past its last checkpoint) are not
logged again: a metric is skipped at a step at or before the last the run holds for it, and a
table whose artifact is there already.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
from typing import Optional

from jetrl.config import FlagError
from jetrl.train.run_files import refuse_link, write_atomic
from jetrl.train.sinks.base import SAMPLE_COLUMNS, Backend, sample_rows

MLFLOW_ID_FILE = "mlflow_run_id"  # <workdir>/<prefix>mlflow_run_id: kept for a resume
_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")
_PARAMS_PER_BATCH = 100  # MLflow's limit on the params of one log_batch call
_PARAM_LENGTH = 6000  # and on a param value's length


def import_mlflow():
  """The mlflow module, or a one-line FlagError saying how to install it (checked when a run
  with `--logging.mlflow` starts: `jetrl.train.driver.run_guarded`)."""
  try:
    import mlflow  # pylint: disable=import-outside-toplevel
    from mlflow.tracking import MlflowClient  # noqa: F401  pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise FlagError(
      "logging.mlflow",
      f"needs the mlflow package ({e}): pip install mlflow-skinny, or pip install 'jetrl[mlflow]'",
    ) from None
  return mlflow


def metric_name(key: str) -> str:
  """A metric key as an MLflow metric name. MLflow allows letters, digits, `_ - . /` and
  spaces in a name that is a clean relative path: "@" becomes "_at_", any other character
  "_", and empty, "." and ".." path segments are dropped ("a//b" is "a/b"); the rest, the
  slashes of "agree/kl_k3" or "eval/accuracy" included, is kept as it is."""
  name = _BAD.sub("_", key.replace("@", "_at_"))
  parts = [p for p in name.split("/") if p not in ("", ".", "..")]
  return "/".join(parts)[:250] or "_"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
  """A nested config as {"node.field": text} (each value's JSON, a string as it is)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      text = v if isinstance(v, str) else json.dumps(v)
      out[metric_name(f"{prefix}{k}")] = text[:_PARAM_LENGTH]
  return out


# MLflow 3 refuses a file store unless this environment variable is "true"; a run logging to
# one sets it in its own process (and says to set it for `mlflow ui`).
FILE_STORE_SWITCH = "MLFLOW_ALLOW_FILE_STORE"


def is_file_store(uri: str) -> bool:
  return (
    uri.startswith("file:") or "://" not in uri and not uri.startswith(("sqlite:", "databricks"))
  )


def default_uri(workdir: str) -> str:
  """The file store of a run: <workdir>/mlruns, as a file: URI."""
  return pathlib.Path(os.path.abspath(os.path.join(workdir, "mlruns"))).as_uri()


class MLflow:
  """The MLflow run of a workdir (`--logging.mlflow`); started on first use."""

  def __init__(
    self,
    workdir: str,
    *,
    uri: Optional[str] = None,
    experiment: str = "jetrl",
    name: Optional[str] = None,
    id_file: str = MLFLOW_ID_FILE,
  ):
    import_mlflow()
    from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel

    self.workdir = workdir
    self.uri = uri or default_uri(workdir)
    self.experiment = experiment
    self.name = name or os.path.basename(os.path.normpath(workdir))
    self.id_path = os.path.join(workdir, id_file)
    self.file_store = is_file_store(self.uri)
    if self.file_store:  # MLflow 3 keeps its file store behind this switch
      os.environ.setdefault(FILE_STORE_SWITCH, "true")
    self.client = MlflowClient(tracking_uri=self.uri)
    self.run_id: Optional[str] = None
    self._last: dict[str, int] = {}  # metric -> the last step an earlier process logged
    self._tables: set[str] = set()  # the table artifacts the run holds

  def where(self) -> str:
    if self.uri.startswith(("http://", "https://")):
      look = f"open {self.uri}"
    else:
      switch = f"{FILE_STORE_SWITCH}=true " if self.file_store else ""
      look = f"{switch}mlflow ui --backend-store-uri {self.uri}"
    return f"MLflow: {self.uri}, experiment {self.experiment!r}, run {self.name!r} (look: {look})"

  def _kept_id(self) -> Optional[str]:
    if not os.path.lexists(self.id_path):
      return None
    refuse_link(self.id_path)
    with open(self.id_path, encoding="utf-8", errors="replace") as f:
      run_id = f.read(300).strip()
    if run_id and not re.fullmatch(r"[A-Za-z0-9][\w\-]{0,255}", run_id):
      raise ValueError(
        f"{self.id_path}: not an MLflow run id ({run_id[:40]!r}) (delete the file to start a "
        "new MLflow run)"
      )
    return run_id or None

  def _open(self) -> str:
    if self.run_id is not None:
      return self.run_id
    kept = self._kept_id()
    run = None
    if kept is not None:
      from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel

      try:
        run = self.client.get_run(kept)
      except MlflowException:  # another store (--logging.mlflow_uri changed): a new run there
        run = None
    if run is not None:
      for key in run.data.metrics:
        steps = [m.step for m in self.client.get_metric_history(kept, key)]
        self._last[key] = max(steps, default=-1)
      self._tables = {a.path for a in self.client.list_artifacts(kept, "samples")}
      self.client.update_run(kept, status="RUNNING")
      self.run_id = kept
    else:
      exp = self.client.get_experiment_by_name(self.experiment)
      exp_id = (
        exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
      )
      self.run_id = self.client.create_run(exp_id, run_name=self.name).info.run_id
      write_atomic(self.id_path, self.run_id + "\n")
    return self.run_id

  def config(self, tree: dict) -> None:
    """The configuration as params (those the run holds already are not logged again: MLflow
    refuses to change a param, and a resume may change the resumable flags) and as
    config.json."""
    from mlflow.entities import Param  # pylint: disable=import-outside-toplevel

    run_id = self._open()
    held = self.client.get_run(run_id).data.params
    params = [Param(k, v) for k, v in flatten(tree).items() if k not in held]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
      self.client.log_batch(run_id, params=params[i : i + _PARAMS_PER_BATCH])
    self.client.log_text(run_id, json.dumps(tree, indent=1), "config.json")

  def scalars(self, step: int, values: dict[str, float]) -> None:
    from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel

    run_id = self._open()
    now = int(time.time() * 1000)
    metrics = []
    for key, v in values.items():
      name = metric_name(key)
      if step > self._last.get(name, -1):
        metrics.append(Metric(name, float(v), now, int(step)))
    for i in range(0, len(metrics), 1000):
      self.client.log_batch(run_id, metrics=metrics[i : i + 1000])

  def samples(self, step: int, records: list[dict]) -> None:
    run_id = self._open()
    path = f"samples/step_{int(step):08d}.json"
    if path in self._tables:
      return
    table = {"columns": list(SAMPLE_COLUMNS), "data": sample_rows(records)}
    self.client.log_text(run_id, json.dumps(table), path)
    self._tables.add(path)

  def artifacts(self, paths: list[str]) -> None:
    run_id = self._open()
    for p in paths:
      if os.path.isfile(p):
        self.client.log_artifact(run_id, p, "plots")

  def close(self) -> None:
    if self.run_id is not None:
      self.client.set_terminated(self.run_id)
      self.run_id = None


def _open(cfg, prefix: str, start: int) -> MLflow:
  del start
  lg = cfg.logging
  return MLflow(
    cfg.workdir,
    uri=lg.mlflow_uri,
    experiment=lg.mlflow_experiment,
    name=lg.mlflow_run_name,
    id_file=prefix + MLFLOW_ID_FILE,
  )


BACKEND = Backend(
  "mlflow",
  lambda logging: logging.mlflow,
  _open,
  import_mlflow,
  files=(MLFLOW_ID_FILE, "mlruns"),
)
