"""`python -m jetrl.launch`: flags, environment, prefixed output, and a failed child stopping
the others. The children here are small Python programs (no JAX); the launcher running real
multi-process training is tests/parallel/test_multi_process.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from jetrl import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(*args, env=None, timeout=60):
  t0 = time.monotonic()
  proc = subprocess.run(
    [sys.executable, "-m", "jetrl.launch", *args],
    cwd=ROOT,
    env=dict(os.environ if env is None else env, PYTHONPATH=os.path.join(ROOT, "src")),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  proc.seconds = time.monotonic() - t0
  return proc


@pytest.mark.parametrize(
  "args,message",
  [
    (["--processes=0", "--", "x.py"], "--processes must be >= 1, got 0"),
    (["--processes=2", "--local_devices=0", "--", "x.py"], "--local_devices must be >= 1"),
    (["--processes=2", "x.py"], "missing `--` before the command"),
    (["--processes=2", "--"], "no command after `--`"),
    (["--processes=2", "--process_id=2", "--coordinator=h:1", "--", "x.py"], "in [0, 1]"),
    (["--processes=2", "--process_id=1", "--", "x.py"], "needs --coordinator"),
    (["--processes=2", "--coordinator=nohost", "--", "x.py"], "must be HOST:PORT"),
  ],
)
def test_bad_flags_are_clear_errors(args, message):
  with pytest.raises(launch.LaunchError, match=None) as e:
    launch.parse_args(args)
  assert message in str(e.value)


def test_local_devices_need_the_cpu_backend(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  with pytest.raises(launch.LaunchError, match="JAX_PLATFORMS=cuda selects another backend"):
    launch.parse_args(["--processes=2", "--local_devices=2", "--", "x.py"])
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  args, command = launch.parse_args(["--processes=2", "--local_devices=2", "--", "x.py", "-v"])
  assert args.local_devices == 2 and command == [sys.executable, "x.py", "-v"]


def test_child_environment():
  base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1", "A": "b"}
  env = launch.child_env(
    base, process_id=1, processes=2, coordinator="127.0.0.1:123", local_devices=3, heartbeat=7
  )
  assert env["JAX_PROCESS_ID"] == "1" and env["JAX_NUM_PROCESSES"] == "2"
  assert env["JAX_COORDINATOR_ADDRESS"] == env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:123"
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=3"
  assert env["JAX_PLATFORMS"] == "cpu" and env["JETRL_HEARTBEAT_TIMEOUT"] == "7"
  assert env["JETRL_LAUNCHED"] == "1"
  one = launch.child_env(
    base, process_id=0, processes=1, coordinator="h:1", local_devices=None, heartbeat=None
  )
  assert "JAX_COORDINATOR_ADDRESS" not in one and one["XLA_FLAGS"] == base["XLA_FLAGS"]


CHILD = textwrap.dedent(
  """
  import os, signal, sys, time
  i = int(os.environ["JAX_PROCESS_ID"])
  print(f"hello from {i} of {os.environ['JAX_NUM_PROCESSES']} "
        f"at {os.environ.get('JAX_COORDINATOR_ADDRESS')}", flush=True)
  print(f"[Gloo] Rank {i} is connected to 2 peer ranks. Expected number of connected peer "
        "ranks is : 2", flush=True)
  mode = sys.argv[1]
  if mode == "fail" and i == 1:
    time.sleep(0.3)
    sys.exit(3)
  if mode == "kill" and i == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
  if mode != "ok":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a JAX process with preemption on
    time.sleep(60)
  """
)


def test_every_process_runs_with_its_id_and_prefixed_output(tmp_path):
  proc = _launch("--processes=3", f"--log_dir={tmp_path}", "--", "-c", CHILD, "ok")
  assert proc.returncode == 0, proc.stderr
  lines = sorted(line for line in proc.stdout.splitlines() if "hello" in line)
  assert [line[:17] for line in lines] == [f"[p{i}] hello from {i}" for i in range(3)]
  assert all("of 3 at 127.0.0.1:" in line for line in lines)
  assert open(tmp_path / "process_2.log").read().startswith("hello from 2 of 3")
  assert "3 of 3 processes started" in proc.stderr
  # gloo's connection lines go to the log files only, unless asked for.
  assert "[Gloo]" not in proc.stdout
  assert "[Gloo] Rank 2 is connected to 2 peer ranks" in open(tmp_path / "process_2.log").read()
  shown = _launch("--processes=2", "--gloo_lines", "--", "-c", CHILD, "ok")
  assert shown.returncode == 0 and "[p1] [Gloo] Rank 1 is connected" in shown.stdout


@pytest.mark.parametrize(
  "mode,code,what", [("fail", 3, "exited with code 3"), ("kill", 137, "was killed by SIGKILL")]
)
def test_a_failed_process_stops_the_others_and_is_named(mode, code, what):
  proc = _launch("--processes=3", "--grace=0.5", "--", "-c", CHILD, mode)
  assert proc.returncode == code, (proc.stdout, proc.stderr)
  assert "process 1 of 3 (pid" in proc.stderr and what in proc.stderr
  assert "stopping processes 0, 2" in proc.stderr
  assert proc.seconds < 20, proc.seconds  # the others ignore SIGTERM: SIGKILL after --grace


def test_one_process_of_many_needs_a_coordinator():
  proc = _launch("--processes=2", "--process_id=1", "--", "-c", CHILD, "ok")
  assert proc.returncode == 2 and "needs --coordinator" in proc.stderr
  proc = _launch(
    "--processes=2", "--process_id=1", "--coordinator=10.0.0.1:9", "--", "-c", CHILD, "ok"
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "[p1] hello from 1 of 2 at 10.0.0.1:9"


class _Exited:
  def __init__(self, code):
    self.code = code

  def poll(self):
    return self.code


@pytest.mark.parametrize(
  "codes,named",
  [
    ({0: 1, 1: -9, 2: None}, (1, -9)),  # the peer of a killed process exited first: name the kill
    ({0: None, 1: 3, 2: 1}, (1, 3)),  # no signal: the lowest id that failed
    ({0: 0, 1: 0, 2: 0}, (None, 0)),
  ],
)
def test_the_killed_process_is_named_when_its_peers_fail_by_the_same_poll(codes, named):
  run = object.__new__(launch.Launch)
  run.ids, run.procs = list(codes), {i: _Exited(c) for i, c in codes.items()}
  assert run.wait(poll=0) == named


class _Proc(_Exited):
  def __init__(self, code, pid):
    super().__init__(code)
    self.pid = pid


def test_the_failure_line_names_peers_to_stop_and_peers_already_gone():
  procs = {0: _Proc(1, 10), 1: _Proc(-9, 11), 2: _Proc(None, 12), 3: _Proc(-6, 13)}
  assert launch.failure_line(1, -9, 4, procs) == (
    "process 1 of 4 (pid 11) was killed by SIGKILL; stopping process 2"
    "; process 0 had already exited with code 1; process 3 had already been killed by SIGABRT"
  )
  procs = {0: _Proc(None, 10), 1: _Proc(3, 11), 2: _Proc(None, 12)}
  assert launch.failure_line(1, 3, 3, procs) == (
    "process 1 of 3 (pid 11) exited with code 3; stopping processes 0, 2"
  )
