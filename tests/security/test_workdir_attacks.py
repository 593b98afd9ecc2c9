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
