"""Ctrl-C during a run: the first interrupt finishes the step, writes its checkpoint, says in
one line what was saved and how to resume, and exits with code 130; the rerun continues from
that step (the command line, RL), exactly as an uninterrupted run would have (in-process,
SFT: the same records and params)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np

from jetrl.train.hooks import Hook
from jetrl.train.interrupt import EXIT_CODE, Interrupts, RunInterrupted
from jetrl.train.validation import checkpoint_steps

STEPS = 300  # a tiny step takes milliseconds: enough steps that the signal lands among them


def _records(path) -> list[dict]:
  out = []
  for line in open(path, encoding="utf-8"):
    r = json.loads(line)
    out.append({k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s/"))})
  return out


def test_a_first_interrupt_saves_the_step_and_the_rerun_continues_from_it(tmp_path, root):
  def command(workdir):
    return [
      sys.executable,
      str(root / "experiments" / "train.py"),
      f"--workdir={workdir}",
      "--model.n_layers=1",
      "--task.difficulty=1",
      "--task.length=1",
      "--eval.size=2",
      "--eval.every=none",
      f"--steps={STEPS}",
      "--prompts_per_step=2",
      "--sampling.n=2",
      "--sampling.max_new_tokens=4",
      "--checkpoint.every=1000",
      "--logging.tensorboard=false",
      "--logging.plots=false",
      "--logging.samples_every=none",
    ]

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("PYTHONUNBUFFERED", None)  # the lines come as they are printed: cli.line_buffered
  # SIGINT as a terminal's foreground job has it (a shell's background job ignores it).
  popen = dict(
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
  )
  cut = subprocess.Popen(command(tmp_path / "cut"), **popen)
  seen = []
  for line in cut.stdout:
    seen.append(line)
    if f"step 2/{STEPS}" in line:
      cut.send_signal(signal.SIGINT)
      break
  out, err = cut.communicate(timeout=300)
  out = "".join(seen) + out
  assert cut.returncode == EXIT_CODE, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  saved = checkpoint_steps(str(tmp_path / "cut"))
  assert len(saved) == 1 and 2 <= saved[0] < STEPS, (saved, out[-2000:])
  step = saved[0]
  assert f"interrupt: finishing step {step}, then saving a checkpoint" in out
  line = err.strip().splitlines()[-1]
  assert line.startswith(
    f"train.py: interrupted: saved the checkpoint of step {step} in "
    f"{tmp_path / 'cut' / 'checkpoints'}; resume with: "
  ), line
  assert line.endswith(f"--workdir={tmp_path / 'cut'} " + " ".join(command("x")[3:])), line
  # The step's records are written; none past it.
  assert [r["step"] for r in _records(tmp_path / "cut" / "metrics.jsonl")] == list(
    range(1, step + 1)
  )

  rerun = subprocess.run(command(tmp_path / "cut"), capture_output=True, text=True, env=env)
  assert "taking over the lock" not in rerun.stdout  # released at the interrupt
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"(step {step}, data position {2 * step})" in rerun.stdout
  assert [r["step"] for r in _records(tmp_path / "cut" / "metrics.jsonl")] == list(
    range(1, STEPS + 1)
  )
  assert checkpoint_steps(str(tmp_path / "cut"))[-1] == STEPS


class InterruptAt(Hook):
  """Sends this process a SIGINT after step `at` (as Ctrl-C in a terminal would)."""

  every = 1
  at_end = False

  def __init__(self, at: int):
    self.at = at

  def __call__(self, step, loop):
    if step == self.at:
      os.kill(os.getpid(), signal.SIGINT)


def test_sft_stops_at_the_interrupted_step_with_its_checkpoint(
  tmp_path, tiny_sft_config, monkeypatch
):
  """In-process (a notebook's case): RunInterrupted after step 2's checkpoint (not due: every
  10), the handler restored, and the rerun ends where an uninterrupted run ends."""
  from jetrl.train import run_sft
  from jetrl.train.checkpoint import Checkpointer

  lines = []
  cfg = tiny_sft_config(tmp_path / "cut")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
  try:
    run_sft(cfg, log=lines.append, hooks=[InterruptAt(2)])
    raise AssertionError("not interrupted")
  except RunInterrupted as e:
    assert (e.step, e.directory) == (2, str(tmp_path / "cut" / "checkpoints"))
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  signal.signal(signal.SIGINT, previous)
  assert checkpoint_steps(str(tmp_path / "cut")) == [2]
  assert any(line.startswith("interrupt: finishing step 2") for line in lines), lines
  run_sft(cfg, log=lines.append)
  run_sft(tiny_sft_config(tmp_path / "whole"), log=lines.append)
  assert _records(tmp_path / "cut" / "sft_metrics.jsonl") == _records(
    tmp_path / "whole" / "sft_metrics.jsonl"
  )
  params = []
  for d in ("cut", "whole"):
    ck = Checkpointer(str(tmp_path / d))
    params.append(ck._mngr.restore(4).state["params"])
    ck.close()
  for x, y in zip(*(jax.tree_util.tree_leaves(p) for p in params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_second_interrupt_exits_at_once(monkeypatch):
  """The second interrupt ends the process with code 130 from the listening thread."""
  codes, lines = [], []
  monkeypatch.setattr(os, "_exit", codes.append)
  watch = Interrupts(lines.append)
  watch.step = 5
  watch.heard()
  assert watch.requested and codes == []
  watch.heard()
  assert codes == [130]
  assert lines[0].startswith("interrupt: finishing step 5, then saving a checkpoint")
  assert lines[1].startswith("second interrupt: stopped at once")
