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
    first_checkpoint=4,
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
  start_fresh(str(tmp_path), ("metrics.jsonl",), (), first_checkpoint=4, overwrite=False)
  # A record at the step the first checkpoint was due means that checkpoint is gone.
  write_records(tmp_path / "metrics.jsonl", [1, 2, 3])
  with pytest.raises(FlagError, match="first checkpoint was due at step 3; pass --overwrite"):
    start_fresh(str(tmp_path), ("metrics.jsonl",), (), first_checkpoint=3, overwrite=False)


def _earlier_run(workdir, steps, every, last):
  """A workdir as a `steps`-step RL run checkpointing every `every` steps leaves after writing
  the metrics of steps 1..last (and its summary, when it finished), with its checkpoints/
  removed."""
  from jetrl.train import TrainConfig

  cfg = TrainConfig(workdir=str(workdir)).replace(steps=steps, checkpoint={"every": every})
  (workdir / "config.json").write_text(json.dumps(cfg.to_dict()))
  write_records(workdir / "metrics.jsonl", range(1, last + 1))
  write_records(workdir / "eval.jsonl", [0])
  if last == steps:
    (workdir / "summary.json").write_text("{}")


@pytest.mark.parametrize(
  "earlier, rerun, due",
  [
    # A finished 10-step run checkpointing every 10 steps, rerun with the same flags: its
    # last records are at the step its checkpoint was written.
    ((10, 10, 10), (10, 10), 10),
    # A finished 30-step run (checkpoints every 10 steps) rerun with --steps=50
    # --checkpoint.every=50: the rerun's own first checkpoint (50) is past every record.
    ((30, 10, 30), (50, 50), 10),
    # A 5-step run checkpointing every 10: its only checkpoint, at its end, was due at 5.
    ((5, 10, 5), (10, 10), 5),
  ],
)
def test_metrics_past_the_earlier_runs_first_checkpoint_are_refused(tmp_path, earlier, rerun, due):
  _earlier_run(tmp_path, *earlier)
  before = (tmp_path / "metrics.jsonl").read_text()
  steps, every = rerun
  with pytest.raises(
    FlagError,
    match=rf"holds metrics of an earlier run .* no checkpoint to resume from, although its "
    rf"first checkpoint was due at step {due} \(its config.json\); pass --overwrite",
  ):
    start_fresh(
      str(tmp_path),
      ("metrics.jsonl", "eval.jsonl"),
      ("config.json",),
      first_checkpoint=min(steps, every),
      overwrite=False,
      config_file="config.json",
      summary_file="summary.json",
    )
  assert (tmp_path / "metrics.jsonl").read_text() == before
  assert not (tmp_path / PREVIOUS_DIR).exists()


def test_a_run_killed_before_its_own_first_checkpoint_is_judged_by_its_config(tmp_path):
  # Killed at step 9 of a run checkpointing every 10 steps: nothing was due, even though the
  # rerun checkpoints every 5 steps (its own interval would have called step 5 due).
  _earlier_run(tmp_path, 30, 10, 9)
  logs = []
  start_fresh(
    str(tmp_path),
    ("metrics.jsonl", "eval.jsonl"),
    ("config.json",),
    first_checkpoint=5,
    overwrite=False,
    log=logs.append,
    config_file="config.json",
  )
  (moved,) = os.listdir(tmp_path / PREVIOUS_DIR)
  assert sorted(os.listdir(tmp_path / PREVIOUS_DIR / moved)) == [
    "config.json",
    "eval.jsonl",
    "metrics.jsonl",
  ]
  assert "no checkpoint was written" in logs[0]
  # Without a readable saved config, the rerun's own first checkpoint decides.
  write_records(tmp_path / "metrics.jsonl", range(1, 10))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(FlagError, match="first checkpoint was due at step 5; pass --overwrite"):
    start_fresh(
      str(tmp_path),
      ("metrics.jsonl",),
      (),
      first_checkpoint=5,
      overwrite=False,
      config_file="config.json",
    )


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


def test_a_run_killed_during_its_first_save_is_moved_aside(tmp_path):
  # Killed after writing step 10's records, before step 10's checkpoint was complete (the
  # records come first): unfinished (no summary.json), so nothing was lost and the rerun
  # starts afresh without --overwrite.
  _earlier_run(tmp_path, 30, 10, 10)
  kw = dict(first_checkpoint=10, overwrite=False, config_file="config.json")
  logs = []
  start_fresh(
    str(tmp_path),
    ("metrics.jsonl", "eval.jsonl"),
    ("config.json", "summary.json"),
    log=logs.append,
    summary_file="summary.json",
    **kw,
  )
  assert "no checkpoint was written" in logs[0]
  # One record further, the checkpoint of step 10 had been written (and is gone): refused.
  _earlier_run(tmp_path, 30, 10, 11)
  with pytest.raises(FlagError, match="first checkpoint was due at step 10"):
    start_fresh(str(tmp_path), ("metrics.jsonl",), (), summary_file="summary.json", **kw)


def tensorboard_points(directory) -> dict:
  """{tag: [(step, value), ...]} as TensorBoard shows the event files of `directory`: the
  files read in name order, a session start at step S dropping every point read before it at
  step S and past (TensorBoard's handling of a restarted writer)."""
  from tensorboardX.proto.event_pb2 import SessionLog

  from conftest import tensorboard_events

  points = {}
  for event in tensorboard_events(directory):
    if event.HasField("session_log") and event.session_log.status == SessionLog.START:
      points = {t: [p for p in ps if p[0] < event.step] for t, ps in points.items()}
    for v in event.summary.value:
      points.setdefault(v.tag, []).append((event.step, round(v.simple_value, 6)))
  return points


def test_a_resumed_run_shows_one_tensorboard_point_per_step(tmp_path, tiny_train_config):
  from jetrl.train import driver
  from jetrl.train.writers import TensorBoard

  # The interrupted run wrote steps 1..4; its last checkpoint was step 2.
  tb = TensorBoard(str(tmp_path))
  writer = MetricWriter(str(tmp_path), "metrics", tb)
  for step in (1, 2, 3, 4):
    writer.write(step, {"loss": float(step)})
  tb.close()
  # The resumed run (no second gone by: the file names must not collide) redoes 3 and 4.
  out = driver.open_outputs(
    tiny_train_config(tmp_path, logging={"tensorboard": True}), driver.RL, start=2
  )
  assert out.tb.purge_step == 3
  writer = out.writer("metrics")
  writer.truncate_after(2)
  for step in (3, 4, 5):
    writer.write(step, {"loss": 10.0 * step})
  out.close()
  assert len(os.listdir(tmp_path / "tb")) == 2
  assert tensorboard_points(tmp_path / "tb") == {
    "loss": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
  }
  assert [r["loss"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 30, 40, 50]
  # A fresh start purges nothing.
  assert driver.open_outputs(tiny_train_config(tmp_path), driver.RL).tb is None
  fresh = driver.open_outputs(tiny_train_config(tmp_path, logging={"tensorboard": True}), driver.RL)
  assert fresh.tb.purge_step is None


def test_a_failed_start_leaves_no_lock_in_a_new_workdir(tmp_path, tiny_train_config):
  """A run refused after it took its new workdir (gsm8k needs a tokenizer the tiny preset
  lacks) removes the workdir it made: nothing but its lock was in it. A workdir that was
  there before is kept."""
  from conftest import quiet
  from jetrl.train import run

  for workdir in (tmp_path / "new", tmp_path / "a" / "b"):
    cfg = tiny_train_config(workdir, task={"name": "gsm8k"})
    with pytest.raises(FlagError, match="needs a tokenizer"):
      run(cfg, log=quiet)
    assert not workdir.exists()
  (tmp_path / "old").mkdir()
  with pytest.raises(FlagError, match="needs a tokenizer"):
    run(tiny_train_config(tmp_path / "old", task={"name": "gsm8k"}), log=quiet)
  assert (tmp_path / "old").is_dir()


def test_more_steps_on_a_finished_run_say_that_it_is_extended(tmp_path, tiny_sft_config):
  from jetrl.train import run_sft

  cfg = tiny_sft_config(tmp_path, steps=2, optimizer={"schedule": "constant", "warmup_steps": 0})
  run_sft(cfg, log=lambda line: None)
  lines = []
  run_sft(cfg.replace(steps=3), log=lines.append)
  assert "extending a finished run from 2 to 3 steps (--steps=3)" in lines
  # Records every 10 steps and at each run's end: the first run's 2, the extension's 3.
  assert [r["step"] for r in read_jsonl(str(tmp_path / "sft_metrics.jsonl"))] == [2, 3]


def test_a_run_starts_by_bounding_its_process_s_code_mappings(
  tmp_path, tiny_train_config, monkeypatch
):
  """Runs trained one after another in one process (a study, a sweep) would reach Linux's cap
  on memory mappings with their compiled programs: each run's start clears JAX's caches past
  half of it, and says so (jetrl.kernels.code_memory)."""
  import jax
  import jax.numpy as jnp

  from jetrl.kernels import code_memory
  from jetrl.train import driver

  f = jax.jit(lambda x: x + 1)
  f(jnp.ones(2)).block_until_ready()
  assert f._cache_size() == 1
  monkeypatch.setattr(code_memory, "mappings", lambda: 10**9)  # as if past the cap
  lines = []
  done = driver.run_guarded(
    tiny_train_config(tmp_path / "run"), None, lines.append, lambda *args: "body ran"
  )
  assert done == "body ran"
  assert f._cache_size() == 0  # cleared before the body
  assert any("vm.max_map_count" in line for line in lines), lines
