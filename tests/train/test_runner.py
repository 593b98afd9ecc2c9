"""The RL runner end to end: every recipe, metrics fields, flag validation, kill and resume."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jetrl.precision import RECIPES
from jetrl.train import TrainConfig, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(model="tiny", n_layers=1, task="addition", difficulty=1, length=2, steps=2,
            prompts_per_step=2, group_size=2, max_new_tokens=16, eval_every=0, eval_size=4,
            ckpt_every=1, tensorboard=False, plots=False, lr=1e-4)
STEP_FIELDS = ["reward_mean", "accuracy", "response_length", "entropy", "loss", "kl",
               "grad_norm", "agree/abs_diff_mean", "agree/abs_diff_max", "agree/kl_k3",
               "agree/bin_abs_diff_mean", "skipped_updates", "time/rollout", "time/reward",
               "time/update", "tokens_per_s/rollout"]


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
# jet_exact's sampler-update loop (zero mismatch at every step) is
# tests/sampling/test_exact_rollout.py; one more end-to-end run would cost ~50 s.
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "jet_exact"])
def test_short_run_every_recipe(tmp_path, recipe):
  cfg = TrainConfig(**dict(TINY, plots=recipe == "jet", tensorboard=recipe == "jet"),
                    recipe=recipe, workdir=str(tmp_path))
  summary = run(cfg, log=lambda *a: None)
  recs = read(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2]
  for r in recs:
    for k in STEP_FIELDS:
      assert k in r, k
      assert np.all(np.isfinite(np.asarray(r[k], float))), (k, r[k])
  evals = read(tmp_path / "eval.jsonl")
  assert [e["step"] for e in evals] == [0, 2]
  assert summary["eval_before"] is not None and summary["skipped_updates"] == 0
  if recipe == "jet":
    assert all(os.path.getsize(p) > 1000 for p in summary["plots"])
    assert any(n.startswith("events") for n in os.listdir(tmp_path / "tb"))


def _train_cmd(workdir, **kw):
  args = dict(TINY, steps=6, ckpt_every=2, recipe="jet", workdir=str(workdir))
  args.update(kw)
  return [sys.executable, os.path.join(ROOT, "experiments", "train.py")] + [
      f"--{k}={v}" for k, v in args.items()]


def _comparable(recs):
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
          for r in recs]


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(tmp_path):
  ref_dir, dir_ = tmp_path / "ref", tmp_path / "killed"
  subprocess.run(_train_cmd(ref_dir), check=True, capture_output=True, timeout=600)
  proc = subprocess.Popen(_train_cmd(dir_), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = dir_ / "checkpoints" / "4"
  deadline = time.time() + 600
  while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)  # mid-run: after checkpoint 4 appeared, before the end
  proc.wait()
  assert ckpt.exists(), "the run never reached its second checkpoint"
  out = subprocess.run(_train_cmd(dir_), check=True, capture_output=True, text=True, timeout=600)
  assert "resumed from" in out.stdout
  ref, got = _comparable(read(ref_dir / "metrics.jsonl")), _comparable(read(dir_ / "metrics.jsonl"))
  assert [r["step"] for r in got] == list(range(1, 7))
  assert got == ref
  assert read(ref_dir / "eval.jsonl")[-1] == read(dir_ / "eval.jsonl")[-1]


def test_checkpoint_from_other_config_is_refused(tmp_path):
  run(TrainConfig(**dict(TINY, steps=1), recipe="bf16", workdir=str(tmp_path)), log=lambda *a: None)
  with pytest.raises(ValueError, match="--recipe: checkpoint has 'bf16', this run has 'jet'"):
    run(TrainConfig(**dict(TINY, steps=2), recipe="jet", workdir=str(tmp_path)), log=lambda *a: None)


@pytest.mark.parametrize("flag,value,message", [
    ("recipe", "fp8", "--recipe: 'fp8' is not accepted"),
    ("group_size", "1", "--group_size: must be >= 2"),
    ("temperature", "0", "--temperature: must be > 0"),
    ("minibatches", "3", "--minibatches: prompts_per_step x group_size = 4 rows"),
    ("model", "/no/such/dir", "--model: '/no/such/dir' is neither a preset"),
    ("task", "chess", "--task: 'chess' is not accepted"),
    ("is_correction", "clip", "--is_correction: 'clip' is not accepted"),
])
def test_bad_flags_fail_fast_naming_the_flag(tmp_path, flag, value, message):
  t0 = time.time()
  out = subprocess.run(_train_cmd(tmp_path, **{flag: value}), capture_output=True, text=True,
                       timeout=120)
  assert out.returncode != 0
  assert message in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "metrics.jsonl").exists()
  assert time.time() - t0 < 60, "validation must happen before any compilation"


def test_every_config_field_is_a_flag():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--helpfull"],
                       capture_output=True, text=True, timeout=120)
  import dataclasses
  for f in dataclasses.fields(TrainConfig):
    assert f"--{f.name}:" in out.stdout or f"--[no]{f.name}:" in out.stdout, f.name
