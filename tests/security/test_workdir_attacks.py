"""A workdir's files are never written through a symbolic link: a link planted as `.lock`,
`metrics.jsonl`, `config.json` or a plot leaves its target as it was (a run once emptied the
target of `.lock` and overwrote that of `config.json`)."""

from __future__ import annotations

import json
import os

import pytest

from jetrl.config import FlagError
from jetrl.train import driver
from jetrl.train.run_files import write_atomic
from jetrl.train.workdir import WorkdirLock
from jetrl.train.writers import MetricWriter

SECRET = "a user's file: keep me\n"


@pytest.fixture()
def victim(tmp_path):
  path = tmp_path / "victim.txt"
  path.write_text(SECRET)
  return path


@pytest.fixture()
def workdir(tmp_path):
  w = tmp_path / "run"
  w.mkdir()
  return w


def test_a_lock_that_is_a_link_is_refused(workdir, victim):
  os.symlink(victim, workdir / ".lock")
  with pytest.raises(FlagError, match=r"^--workdir: .*\.lock' is a symbolic link"):
    WorkdirLock(str(workdir), log=lambda *a: None)
  assert victim.read_text() == SECRET


def test_a_config_json_link_is_replaced_not_followed(workdir, victim):
  os.symlink(victim, workdir / "config.json")
  out = driver.Outputs(str(workdir), driver.RL, True, None)
  out.write_json("config.json", {"steps": 3})
  assert victim.read_text() == SECRET
  assert not os.path.islink(workdir / "config.json")
  assert json.loads((workdir / "config.json").read_text()) == {"steps": 3}


def test_a_planted_temporary_file_link_is_not_followed(workdir, victim):
  os.symlink(victim, workdir / f"summary.json.tmp-{os.getpid()}")
  write_atomic(str(workdir / "summary.json"), "{}")
  assert victim.read_text() == SECRET
  assert (workdir / "summary.json").read_text() == "{}"


def test_a_metrics_link_is_refused(workdir, victim):
  os.symlink(victim, workdir / "metrics.jsonl")
  writer = MetricWriter(str(workdir))
  with pytest.raises(FlagError, match=r"metrics.jsonl' is a symbolic link"):
    writer.write(1, {"loss": 0.5})
  with pytest.raises(FlagError, match=r"metrics.jsonl' is a symbolic link"):
    writer.truncate_after(0)
  assert victim.read_text() == SECRET


def test_files_written_whole_are_plain_files(workdir):
  writer = MetricWriter(str(workdir))
  writer.write(1, {"loss": 0.5})
  writer.write(2, {"loss": 0.25})
  writer.truncate_after(1)
  assert [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()] == [
    {"step": 1, "loss": 0.5}
  ]
  assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]  # no temporary file left


# A workdir's tree is the run's own: folders as well as files (a planted `tb/`, `plots/` or
# `checkpoints/` link once sent the events, the plots and whole checkpoints into its target,
# exit code 0), checked before the run writes anything.


@pytest.fixture()
def elsewhere(tmp_path):
  d = tmp_path / "elsewhere"
  d.mkdir()
  return d


@pytest.mark.parametrize("name", ["tb", "plots", "checkpoints", "previous", "checkpoints/3"])
def test_a_run_refuses_a_folder_link_in_its_workdir_before_writing(
  workdir, elsewhere, name, tiny_train_config
):
  from jetrl.train import run

  if "/" in name:
    (workdir / "checkpoints").mkdir()
  os.symlink(elsewhere, workdir / name)
  cfg = tiny_train_config(workdir).replace(logging={"tensorboard": True, "plots": True})
  with pytest.raises(FlagError, match=rf"^--workdir: '{workdir / name}' is a symbolic link"):
    run(cfg, log=lambda *a: None)
  assert os.listdir(elsewhere) == []
  assert sorted(os.listdir(workdir)) == sorted({".lock", name.split("/")[0]})  # nothing else
  assert (workdir / ".lock").read_text() == ""  # released


def test_a_link_planted_after_the_start_is_refused_where_it_is_written(workdir, elsewhere):
  """Between the start's check and a write, each folder the run writes in is made (or found)
  without following a link."""
  import jax.numpy as jnp

  from jetrl.train.checkpoint import Checkpointer
  from jetrl.train.plots import save
  from jetrl.train.writers import TensorBoard

  ck = Checkpointer(str(workdir))
  os.rmdir(workdir / "checkpoints")
  os.symlink(elsewhere, workdir / "checkpoints")
  with pytest.raises(FlagError, match=r"checkpoints' is a symbolic link"):
    ck.save(1, {"w": jnp.ones(3)}, {})
  with pytest.raises(FlagError, match=r"checkpoints' is a symbolic link"):
    Checkpointer(str(workdir))
  os.symlink(elsewhere, workdir / "tb")
  with pytest.raises(FlagError, match=r"tb' is a symbolic link"):
    TensorBoard(str(workdir)).scalars(1, {"loss": 1.0})
  os.symlink(elsewhere, workdir / "plots")
  with pytest.raises(FlagError, match=r"plots' is a symbolic link"):
    save(object(), str(workdir / "plots" / "reward.png"))
  assert os.listdir(elsewhere) == []


def test_a_hard_linked_metrics_file_is_refused_not_written_through(workdir, victim):
  from jetrl.train.workdir import take_workdir

  os.link(victim, workdir / "metrics.jsonl")
  with pytest.raises(FlagError, match=r"metrics.jsonl' has 2 hard links"):
    take_workdir(str(workdir), log=lambda *a: None)
  with pytest.raises(FlagError, match=r"metrics.jsonl' has 2 hard links"):
    MetricWriter(str(workdir)).write(1, {"loss": 0.5})
  os.unlink(workdir / ".lock")
  os.link(victim, workdir / ".lock")
  with pytest.raises(FlagError, match=r"\.lock' has 3 hard links"):
    WorkdirLock(str(workdir), log=lambda *a: None)
  assert victim.read_text() == SECRET


def test_the_links_wandb_makes_in_its_folder_are_its_own(workdir, elsewhere):
  """W&B keeps `wandb/latest-run` as a link (in a moved-aside run's folder too); a `wandb`
  folder that is itself a link is refused like any other."""
  from jetrl.train.workdir import take_workdir

  for folder in (workdir / "wandb", workdir / "previous" / "20250101-000000" / "wandb"):
    (folder / "run-1").mkdir(parents=True)
    os.symlink("run-1", folder / "latest-run")
  take_workdir(str(workdir), log=lambda *a: None).release()
  os.rename(workdir / "wandb", elsewhere / "wandb")
  os.symlink(elsewhere / "wandb", workdir / "wandb")
  with pytest.raises(FlagError, match=r"wandb' is a symbolic link"):
    take_workdir(str(workdir), log=lambda *a: None)


def test_a_fifo_in_a_workdir_is_refused(workdir):
  from jetrl.train.workdir import take_workdir

  os.mkfifo(workdir / "eval.jsonl")
  with pytest.raises(FlagError, match=r"eval.jsonl' is not a plain file or folder"):
    take_workdir(str(workdir), log=lambda *a: None)


def test_a_workdir_that_is_a_link_is_resolved_once_and_said(tmp_path, elsewhere, tiny_train_config):
  """The link is followed once, at the start, and named in the log; the folder it points to is
  then checked like any workdir (here it holds a planted link, so the run stops there)."""
  from jetrl.train import run

  link = tmp_path / "run-link"
  os.symlink(elsewhere, link)
  os.symlink(tmp_path, elsewhere / "tb")
  logs = []
  with pytest.raises(FlagError, match=rf"^--workdir: '{elsewhere}/tb' is a symbolic link"):
    run(tiny_train_config(link), log=logs.append)
  assert (
    f"--workdir {link} is a symbolic link to {elsewhere}: the run writes in {elsewhere}" in logs
  )
  from jetrl.train.run_files import resolve_workdir

  assert resolve_workdir(f"{link}/", logs.append) == str(elsewhere)
  assert resolve_workdir(str(elsewhere), logs.append) == str(elsewhere)


def test_a_second_run_on_a_workdir_in_use_is_refused_before_writing(workdir, tiny_train_config):
  """The first run holds `.lock`; a second `run` on the same workdir stops at once, naming the
  holder, and changes nothing of the first run's files."""
  import fcntl

  from jetrl.train import run

  (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
  fd = os.open(workdir / ".lock", os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"4242 otherhost\n", 0)
    with pytest.raises(
      FlagError, match=r"^--workdir: .* is in use by another run \(pid 4242 on otherhost\)"
    ):
      run(tiny_train_config(workdir), log=lambda *a: None)
    assert sorted(os.listdir(workdir)) == [".lock", "metrics.jsonl"]
    assert (workdir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert os.pread(fd, 100, 0) == b"4242 otherhost\n"  # the holder's line kept
  finally:
    os.close(fd)


def test_train_py_exits_with_code_2_naming_a_planted_folder_link(workdir, elsewhere):
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  os.symlink(elsewhere, workdir / "checkpoints")
  result = subprocess.run(
    [sys.executable, os.path.join(root, "experiments", "train.py"), f"--workdir={workdir}"],
    env=dict(os.environ, PYTHONPATH=os.path.join(root, "src"), JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
    f"train.py: error: --workdir: '{workdir}/checkpoints' is a symbolic link; a run's workdir "
    "holds only its own files and folders, never links, so that nothing is written elsewhere "
    "(remove the link, or use another --workdir)"
  )
  assert os.listdir(elsewhere) == []
