"""An export writes its own folder and removes nothing it did not write. `--out` naming the
run's workdir with `--overwrite` once left the workdir holding only the exported model (its
checkpoints, metrics and plots deleted, exit code 0); `--out` naming the workdir's parent
deleted the run and an unrelated file beside it."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys

import pytest

from jetrl.config import FlagError
from jetrl.train import pieces
from jetrl.train.checkpoint import Checkpointer
from jetrl.train.config import ModelSpec
from jetrl.train.export import ExportConfig, export_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def quiet(*_):
  pass


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run's workdir: a checkpoint of a 1-layer tiny model at step 2, metrics, a plot."""
  w = tmp_path_factory.mktemp("runs") / "run"
  model = ModelSpec(name="tiny", n_layers=1)
  tok = pieces.make_tokenizer(model)
  mcfg = pieces.model_config(model, tok, 0)
  params = pieces.make_params(model, mcfg, 0)
  ck = Checkpointer(str(w))
  ck.save(2, {"params": params}, {"kind": "rl", "config": {"model": dataclasses.asdict(model)}})
  ck.close()
  (w / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
  (w / "plots").mkdir()
  (w / "plots" / "reward.png").write_bytes(b"png")
  return w


def tree(path) -> dict:
  """Every file under `path` with its bytes (folders as None)."""
  out = {}
  for root, dirs, files in os.walk(path):
    for n in dirs:
      out[os.path.relpath(os.path.join(root, n), path)] = None
    for n in files:
      with open(os.path.join(root, n), "rb") as f:
        out[os.path.relpath(os.path.join(root, n), path)] = f.read()
  return out


def cli(*args):
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", "export_hf.py"), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_out_as_the_workdir_or_its_parent_is_refused_and_nothing_is_touched(run_dir):
  parent = run_dir.parent
  (parent / "unrelated.txt").write_text("keep me")
  before = tree(parent)
  for out, says in (
    (run_dir, "is the run's --workdir"),
    (parent, "holds the run's --workdir"),
    (run_dir / "hf", "is inside the run's --workdir"),
    (run_dir / "checkpoints", "is inside the run's --workdir"),
  ):
    result = cli(f"--workdir={run_dir}", f"--out={out}", "--overwrite")
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"export_hf.py: error: --out: '{out}' {says} '{run_dir}'"), line
    assert "give a path outside the run" in line
    assert tree(parent) == before


def test_out_inside_or_around_another_run_is_refused(run_dir, tmp_path):
  other = tmp_path / "other"
  (other / "checkpoints" / "5").mkdir(parents=True)
  (other / "sft_metrics.jsonl").write_text('{"step": 1}\n')
  before = tree(tmp_path)
  for out in (other, other / "hf", other / "checkpoints" / "5"):
    with pytest.raises(
      FlagError, match=rf"^--out: '{out}' is (inside )?the workdir of a run \({other}"
    ):
      export_run(ExportConfig(workdir=str(run_dir), out=str(out), overwrite=True), log=quiet)
  with pytest.raises(FlagError, match=r"^--out: .* was not written by an export"):
    export_run(ExportConfig(workdir=str(run_dir), out=str(tmp_path), overwrite=True), log=quiet)
  assert tree(tmp_path) == before


def test_overwrite_replaces_an_earlier_export_and_nothing_else(run_dir, tmp_path):
  out = tmp_path / "hf"
  run_before = tree(run_dir)
  export_run(ExportConfig(workdir=str(run_dir), out=str(out)), log=quiet)
  written = json.loads((out / ".jetrl-export.json").read_text())["files"]
  assert "config.json" in written and "model.safetensors" in written
  assert sorted(os.listdir(out)) == sorted(written + [".jetrl-export.json"])
  first = tree(out)
  with pytest.raises(FlagError, match=r"^--out: .* exists and is not empty; pass --overwrite"):
    export_run(ExportConfig(workdir=str(run_dir), out=str(out)), log=quiet)
  export_run(ExportConfig(workdir=str(run_dir), out=str(out), overwrite=True), log=quiet)
  assert tree(out) == first  # the same checkpoint, the same bytes
  (out / "README.md").write_text("my notes")
  with pytest.raises(
    FlagError, match=r"holds files the earlier export did not write: \['README.md'\]"
  ):
    export_run(ExportConfig(workdir=str(run_dir), out=str(out), overwrite=True), log=quiet)
  assert (out / "README.md").read_text() == "my notes"
  assert tree(run_dir) == run_before  # the export changes nothing in the run
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temporary folder left


def test_an_export_while_the_run_holds_its_lock_reads_without_touching_it(run_dir, tmp_path):
  """A run in progress holds `<workdir>/.lock`; an export reads its newest intact checkpoint
  and changes nothing in the workdir (an in-flight save's temporary folder is not listed)."""
  fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    (run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-123").mkdir()  # a save in flight
    before = tree(run_dir)
    export_run(ExportConfig(workdir=str(run_dir), out=str(tmp_path / "hf")), log=quiet)
    assert tree(run_dir) == before
  finally:
    os.close(fd)
    os.rmdir(run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-123")
    os.unlink(run_dir / ".lock")
