"""Several JAX processes on this machine (CPU, gloo), started by `python -m jetrl.launch`.

One module-scoped series of launches of the tiny runs (1 layer; RL: 2 prompts x 2 samples of
24 new tokens), each in a subprocess with a hard time limit, sharing a persistent compilation
cache (JAX reuses it in process 0 only: on the CPU the other processes' cache keys differ):

  sft1     SFT warm start, 1 process x 2 devices (--mesh=data:2), 1 step
  sft2     the same as 2 processes x 1 device with --steps=2: restores sft1's 1-process
           checkpoint in 2 processes and writes one from both
  one      RL warm-started from sft2, 1 process x 2 devices, --mesh=data:2, 4 steps
  killed   the same as 2 processes x 1 device (run alongside `one`): process 1 killed with
           SIGKILL once the first checkpoint exists
  resumed  the same command again: resumes from the newest complete checkpoint
  two_one  resumed's 2-process checkpoint restored by 1 process, one more step

With 2 devices a cross-device sum has two operands (a + b == b + a), so a 2-process run and a
1-process run on 2 devices compute the same values: rollouts (tokens, lengths, rewards), the
pre-update entropy and every later metric are compared exactly (0 difference measured), floats
within METRIC_TOL in case a backend reorders more than that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = [sys.executable, "-m", "jetrl.launch"]
TIMEOUT = 240  # seconds per launch: a hang fails the test instead of blocking the suite
KILL_BOUND = 30.0  # seconds from the SIGKILL of one process to the launcher's exit
METRIC_TOL = 1e-5
COMMON = [
  "--recipe=bf16",
  "--model.n_layers=1",
  "--task.difficulty=1",
  "--task.length=1",
  "--eval.size=4",
  "--checkpoint.every=1",
  "--nologging.tensorboard",
  "--nologging.plots",
]
RL = COMMON + [
  "--prompts_per_step=2",
  "--sampling.n=2",
  "--sampling.max_new_tokens=24",
  "--sampling.temperature=0.7",
  "--optimizer.lr=1e-4",
  "--eval.every=none",
  "--logging.samples_every=1",
  "--mesh=data:2",
]
SFT = COMMON + [
  "--batch_size=4",
  "--sampling.max_new_tokens=24",
  "--mesh=data:2",
  # A schedule that does not depend on --steps, so the 2-process run may extend the 1-process one.
  "--optimizer.schedule=constant",
  "--optimizer.warmup_steps=0",
]
# Per launch: (processes, host devices per process).
ONE, TWO = (1, 2), (2, 1)


def _env(cache: str) -> dict:
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "SLURM_", "OMPI_", "PMI_", "TPU_", "XLA_FLAGS"))
  }
  env.update(
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    # Compilation dominates on a CPU: a cheaper backend pass, the same for every launch.
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", ""),
  )
  return env


def _command(layout, script, *flags, log_dir=None):
  processes, devices = layout
  cmd = LAUNCH + [f"--processes={processes}", f"--local_devices={devices}"]
  if log_dir:
    cmd.append(f"--log_dir={log_dir}")
  return cmd + ["--", script] + list(flags)


def _run(env, layout, script, *flags):
  t0 = time.monotonic()
  proc = subprocess.run(
    _command(layout, script, *flags),
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
  )
  proc.seconds = time.monotonic() - t0
  print(f"{layout[0]} process(es) {script} {flags[:1]}: rc {proc.returncode}, {proc.seconds:.1f}s")
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  return proc


class Launched:
  """A launch in the background, its output in files (no pipe to fill up)."""

  def __init__(self, env, layout, script, *flags, logs):
    self.out_path, self.err_path = logs + ".out", logs + ".err"
    with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
      self.proc = subprocess.Popen(
        _command(layout, script, *flags), cwd=ROOT, env=env, stdout=out, stderr=err
      )

  def first_line(self) -> str:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
      text = open(self.err_path).read()
      if "\n" in text:
        return text.split("\n")[0]
      time.sleep(0.02)
    raise AssertionError("the launcher printed nothing")

  def wait(self, timeout=TIMEOUT):
    try:
      self.returncode = self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
    self.stdout, self.stderr = open(self.out_path).read(), open(self.err_path).read()
    return self


def _kill_when(launched: Launched, ready, victim=1):
  """SIGKILLs process `victim` of a 2-process launch once `ready()` holds; (the launch, the
  seconds from the kill to the launcher's exit)."""
  pid = int(re.search(rf"p{victim} pid (\d+)", launched.first_line()).group(1))
  deadline = time.monotonic() + TIMEOUT
  while not ready():
    assert launched.proc.poll() is None, "the run ended before the kill"
    assert time.monotonic() < deadline, "no checkpoint before the time limit"
    time.sleep(0.02)
  os.kill(pid, 9)
  t_kill = time.monotonic()
  launched.wait(timeout=KILL_BOUND + 30)
  return launched, time.monotonic() - t_kill


def _steps(workdir) -> list[int]:
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("multi_process")
  env = _env(str(base / "jax_cache"))
  w = {name: str(base / name) for name in ("sft", "one", "killed", "two_one")}
  out = {"workdirs": w}
  t0 = time.monotonic()

  sft = SFT + [f"--workdir={w['sft']}"]
  out["sft1"] = _run(env, ONE, "experiments/sft.py", *sft, "--steps=1")
  out["sft2"] = _run(env, TWO, "experiments/sft.py", *sft, "--steps=2")
  rl = RL + [f"--init_from={w['sft']}", "--steps=4"]
  # The 1-process reference runs alongside the 2-process run that is killed.
  logs = str(base / "log")
  one = Launched(env, ONE, "experiments/train.py", f"--workdir={w['one']}", *rl, logs=logs + "1")
  try:
    killed = rl + [f"--workdir={w['killed']}"]
    launched = Launched(env, TWO, "experiments/train.py", *killed, logs=logs + "2")
    out["killed"], out["kill_wait"] = _kill_when(launched, lambda: _steps(w["killed"]))
    out["latest_after_kill"] = _steps(w["killed"])[-1]
    print(f"kill -9 of process 1 -> launcher exit: {out['kill_wait']:.2f}s")
  finally:
    one.wait()
  assert one.returncode == 0, one.stdout[-6000:] + one.stderr[-3000:]
  out["resumed"] = _run(env, TWO, "experiments/train.py", *killed)

  # resumed's 2-process checkpoint restored by 1 process (sft2 restored 1 -> 2).
  shutil.copytree(w["killed"], w["two_one"])
  more = RL + [f"--init_from={w['sft']}", "--steps=5", f"--workdir={w['two_one']}"]
  out["two_one"] = _run(env, ONE, "experiments/train.py", *more)
  out["total"] = time.monotonic() - t0
  print(f"multi-process launches: {out['total']:.1f}s in all")
  return out


def _comparable(record):
  return {k: v for k, v in record.items() if not k.startswith(("time/", "tokens_per_s"))}


def test_two_processes_equal_one_process_on_two_devices(runs):
  w = runs["workdirs"]
  one = read(os.path.join(w["one"], "samples.jsonl"))
  two = read(os.path.join(w["killed"], "samples.jsonl"))
  # The same rollouts (tokens, lengths, rewards, verdicts), row for row: the completions
  # table's one row of each of the 2 prompts a step; the rows' |Δ log p| within the metrics'
  # tolerance.
  assert [r["step"] for r in one] == [1] * 2 + [2] * 2 + [3] * 2 + [4] * 2
  for a, b in zip(one, two):
    x, y = a.pop("abs_dlogp"), b.pop("abs_dlogp")
    assert (x is None) == (y is None) and (x is None or abs(x - y) <= METRIC_TOL), (x, y)
  assert one == two
  m_one = read(os.path.join(w["one"], "metrics.jsonl"))
  m_two = read(os.path.join(w["killed"], "metrics.jsonl"))
  assert m_one[0]["entropy"] == m_two[0]["entropy"]  # pre-update (1 minibatch, 1 epoch)
  worst = 0.0
  for a, b in zip(m_one, m_two):
    a, b = _comparable(a), _comparable(b)
    assert a.keys() == b.keys()
    for k in a:
      if isinstance(a[k], float):
        worst = max(worst, abs(a[k] - b[k]))
        assert a[k] == pytest.approx(b[k], abs=METRIC_TOL), (a["step"], k)
      else:
        assert a[k] == b[k], (a["step"], k)
  print(f"largest metric difference, 1 vs 2 processes: {worst}")
  evals = (read(os.path.join(w[k], "eval.jsonl")) for k in ("one", "killed"))
  assert next(evals) == next(evals)  # greedy evaluation gathered across processes


def test_one_record_per_step_written_by_the_primary_only(runs):
  w = runs["workdirs"]
  for name in ("killed", "two_one"):
    steps = [r["step"] for r in read(os.path.join(w[name], "metrics.jsonl"))]
    assert steps == list(range(1, len(steps) + 1)), (name, steps)
  assert [r["step"] for r in read(os.path.join(w["killed"], "eval.jsonl"))] == [0, 4]
  assert [r["step"] for r in read(os.path.join(w["sft"], "sft_metrics.jsonl"))] == [1, 2]
  assert [r["step"] for r in read(os.path.join(w["sft"], "sft_eval.jsonl"))] == [1, 2]
  out = runs["resumed"].stdout
  assert re.search(r"^\[p0\] \[#+\.*\] step 4/4", out, re.M), out[-3000:]
  assert not re.search(r"^\[p1\] \[#", out, re.M)  # progress lines from process 0 only
  # The run's header, evaluations and last line too; gloo's connection lines are not shown.
  for said in ("jetrl RL:", "eval @ step 4:", "done: held-out"):
    assert re.search(rf"^\[p0\] .*{re.escape(said)}", out, re.M), (said, out[-3000:])
    assert not re.search(rf"^\[p1\] .*{re.escape(said)}", out, re.M), (said, out[-3000:])
  assert "[Gloo]" not in out
  assert "jax.distributed: process 1 of 2" in out


def test_sigkill_of_one_process_stops_the_run_naming_it(runs):
  killed = runs["killed"]
  assert killed.returncode == 128 + 9, killed.stderr[-3000:]
  assert runs["kill_wait"] < KILL_BOUND, runs["kill_wait"]
  # Process 0 is stopped by the launcher, or has already failed on its own (its collective
  # lost the killed peer) by the time the launcher looks: either way the message says which.
  assert "process 1 of 2" in killed.stderr
  assert re.search(
    r"was killed by SIGKILL; (stopping process 0|process 0 had already "
    r"(exited with code \d+|been killed by \w+))",
    killed.stderr,
  ), killed.stderr[-3000:]
  assert "failed: process 1 was killed by SIGKILL" in killed.stderr


def test_rerun_resumes_from_the_newest_complete_checkpoint(runs):
  w = runs["workdirs"]
  latest = runs["latest_after_kill"]
  out = runs["resumed"].stdout
  assert f"resumed from {w['killed']}/checkpoints/{latest} (step {latest}," in out, out[-3000:]
  # Nothing partial is ever a step: only complete checkpoints are listed, the newest kept.
  names = os.listdir(os.path.join(w["killed"], "checkpoints"))
  assert sorted(n for n in names if n.isdigit()) == ["3", "4"], names
  # Resumed exactly: what the killed and resumed run wrote equals the uninterrupted run.
  for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
    got = [_comparable(r) for r in read(os.path.join(w["killed"], name))]
    want = [_comparable(r) for r in read(os.path.join(w["one"], name))]
    assert got == want, name


def test_checkpoints_restore_across_process_counts(runs):
  w = runs["workdirs"]
  assert "resumed SFT at step 1" in runs["sft2"].stdout  # 1 process -> 2
  assert f"resumed from {w['two_one']}/checkpoints/4 (step 4," in runs["two_one"].stdout  # 2 -> 1
  samples = read(os.path.join(w["two_one"], "samples.jsonl"))
  assert [r["step"] for r in samples] == [s for s in range(1, 6) for _ in range(2)]
  assert read(os.path.join(w["two_one"], "metrics.jsonl"))[-1]["step"] == 5
  # Both RL runs warm-started from the SFT checkpoint written by 2 processes.
  for name in ("one", "killed"):
    assert json.loads(open(os.path.join(w[name], "config.json")).read())["init_from"] == w["sft"]


def test_rows_and_agreement_across_two_processes(tmp_path):
  """Row ownership (sharded and replicated rows), gathering, errors sent from the primary:
  tests/parallel/_hosts_cases.py on 2 processes x 2 devices."""
  proc = _run(_env(str(tmp_path / "jax_cache")), (2, 2), "tests/parallel/_hosts_cases.py")
  for name in ("sharded rows", "replicated rows", "agreement"):
    for i in (0, 1):
      assert f"[p{i}] ok {name}" in proc.stdout, proc.stdout[-3000:]


def test_a_refused_start_stops_every_process_with_the_same_error(tmp_path):
  """A workdir another run holds: process 0 cannot take the lock and every process exits with
  its error, none left waiting for the others. Started without the launcher, from the
  variables a cluster job would set."""
  from jetrl.launch import free_port
  from jetrl.train.workdir import WorkdirLock

  env = _env(str(tmp_path / "jax_cache"))
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2")
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "experiments/train.py", f"--workdir={workdir}", *RL, "--steps=1"]
  os.makedirs(workdir)
  with WorkdirLock(workdir, log=lambda *_: None):
    procs = [
      subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(env, JAX_PROCESS_ID=str(i)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      for i in (0, 1)
    ]
    try:
      results = [p.communicate(timeout=120) for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
  for p, (_, err) in zip(procs, results):
    assert p.returncode == 2, err[-3000:]
    assert "--workdir: " in err and "is in use by another run (pid" in err, err[-3000:]


SCORER = """
import os

def score(prompts, completions, answers):
  with open({log!r}, "a") as f:
    f.write(f"{{os.environ['JAX_PROCESS_ID']}} {{len(completions)}}\\n")
  return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
"""


def test_each_process_scores_the_rows_it_sampled(tmp_path):
  """A reward file that records which process called it with how many completions: in a
  2-process run every batch (the step's 2 prompts x 2 samples, each evaluation's 4 problems)
  is scored half in each process, not gathered and scored on process 0."""
  log = tmp_path / "scored.txt"
  (tmp_path / "scorer.py").write_text(SCORER.format(log=str(log)))
  flags = [f for f in RL if not f.startswith("--eval.every")]
  _run(
    _env(str(tmp_path / "jax_cache")),
    TWO,
    "experiments/train.py",
    *flags,
    f"--workdir={tmp_path / 'run'}",
    f"--task.reward={tmp_path / 'scorer.py'}:score",
    "--steps=1",
    "--eval.every=1",
  )
  calls = [tuple(int(x) for x in line.split()) for line in log.read_text().splitlines()]
  by_process = {p: sorted(n for q, n in calls if q == p) for p in (0, 1)}
  # An evaluation before and after the step (4 problems each) and the step (4 rows): 2 + 2 + 2
  # rows in each process.
  assert by_process == {0: [2, 2, 2], 1: [2, 2, 2]}, calls
