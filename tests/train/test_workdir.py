"""One run per workdir (a live holder refuses, a dead one is taken over), earlier metrics moved
aside and never deleted, torn last lines dropped with a warning."""

import json
import os
import subprocess
import sys

import pytest

from jetrl.train.validation import FlagError
from jetrl.train.workdir import LOCK_NAME, PREVIOUS_DIR, WorkdirLock, start_fresh
from jetrl.train.writers import MetricWriter, read_jsonl

HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()} somehost\\n".encode(), 0)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
  holder = subprocess.Popen(
    [sys.executable, "-c", HOLD_LOCK, str(tmp_path / LOCK_NAME)], stdout=subprocess.PIPE, text=True
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(
      FlagError, match=f"--workdir: .* is in use by another run \\(pid {holder.pid} on somehost\\)"
    ):
      WorkdirLock(str(tmp_path))
  finally:
    holder.kill()
    holder.wait()
  logs = []
  with WorkdirLock(str(tmp_path), log=logs.append):  # the kernel released the dead one's lock
    with pytest.raises(FlagError, match=f"pid {os.getpid()}"):
      WorkdirLock(str(tmp_path))  # also within one process
  assert logs == [
    f"taking over the lock of pid {holder.pid} on somehost in {tmp_path} (no longer running)"
  ]
  with WorkdirLock(str(tmp_path), log=logs.append):  # a clean release leaves nothing to take
    pass
  assert len(logs) == 1


def write_records(path, steps):
  with open(path, "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "loss": 1.0 / s if s else 0.0}) + "\n")


def test_metrics_without_a_checkpoint_are_refused_unless_overwrite(tmp_path):
  write_records(tmp_path / "metrics.jsonl", range(1, 31))
  write_records(tmp_path / "eval.jsonl", [0, 10, 20, 30])
  (tmp_path / "summary.json").write_text("{}")
  before = (tmp_path / "metrics.jsonl").read_text()
  kw = dict(first_checkpoint=10, log=lambda *a: None)
  with pytest.raises(
    FlagError,
    match=r"--workdir: .* holds metrics of an earlier run "
    r"\(metrics\.jsonl \(steps 1\.\.30, 30 records\), "
    r"eval\.jsonl .*pass --overwrite",
  ):
    start_fresh(
      str(tmp_path), ("metrics.jsonl", "eval.jsonl"), ("summary.json",), overwrite=False, **kw
    )
  assert (tmp_path / "metrics.jsonl").read_text() == before  # untouched
  start_fresh(
    str(tmp_path), ("metrics.jsonl", "eval.jsonl"), ("summary.json",), overwrite=True, **kw
  )
  (moved,) = os.listdir(tmp_path / PREVIOUS_DIR)
  assert (tmp_path / PREVIOUS_DIR / moved / "metrics.jsonl").read_text() == before
  assert (tmp_path / PREVIOUS_DIR / moved / "summary.json").exists()
  assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "eval.jsonl").exists()


def test_lines_of_a_run_killed_before_its_first_checkpoint_are_moved_aside(tmp_path):
  write_records(tmp_path / "metrics.jsonl", [1, 2, 3])
  write_records(tmp_path / "eval.jsonl", [0])
  logs = []
  start_fresh(
    str(tmp_path),
    ("metrics.jsonl", "eval.jsonl"),
    (),
    first_checkpoint=3,
    overwrite=False,
    log=logs.append,
  )
  (moved,) = os.listdir(tmp_path / PREVIOUS_DIR)
  assert [r["step"] for r in read_jsonl(tmp_path / PREVIOUS_DIR / moved / "metrics.jsonl")] == [
    1,
    2,
    3,
  ]
  assert "no checkpoint was written" in logs[0]
  start_fresh(str(tmp_path), ("metrics.jsonl",), (), first_checkpoint=3, overwrite=False)


def test_torn_last_line_is_dropped_with_a_warning(tmp_path):
  path = tmp_path / "metrics.jsonl"
  write_records(path, [1, 2, 3])
  with open(path, "a") as f:
    f.write('{"step": 4, "loss": 0.2')  # killed mid-write
  with pytest.warns(RuntimeWarning, match=r"metrics\.jsonl:4: dropping a torn last line"):
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3]
  writer = MetricWriter(str(tmp_path), "metrics", tensorboard=False)
  with pytest.warns(RuntimeWarning, match="torn"):
    writer.truncate_after(2)
  writer.write(3, {"loss": 0.5})
  assert [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3]
  lines = path.read_text().splitlines()
  lines.insert(1, '{"step": oops}')
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record .* damaged"):
    read_jsonl(str(path))
