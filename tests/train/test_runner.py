"""The RL runner end to end: every recipe, metrics fields, flag validation, kill and resume."""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
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


QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
  """A finished 2-step bf16 run (checkpoints 1 and 2); tests work on copies of it."""
  workdir = tmp_path_factory.mktemp("done") / "run"
  cfg = TrainConfig(**TINY, recipe="bf16", workdir=str(workdir))
  run(cfg, **QUIET)
  return cfg


def copy_run(cfg, tmp_path):
  dest = tmp_path / "run"
  shutil.copytree(cfg.workdir, dest)
  return cfg.replace(workdir=str(dest))


def test_checkpoint_from_other_config_is_refused(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  with pytest.raises(ValueError, match="--recipe: checkpoint has 'bf16', this run has 'jet'"):
    run(cfg.replace(recipe="jet"), **QUIET)


def test_damaged_latest_checkpoint_resumes_from_the_one_before(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  files = sorted(glob.glob(f"{cfg.workdir}/checkpoints/2/state/**/d/*", recursive=True),
                 key=os.path.getsize)
  data = bytearray(open(files[-1], "rb").read())
  data[len(data) // 2] ^= 0x40  # one flipped bit
  open(files[-1], "wb").write(bytes(data))
  logs = []
  with pytest.warns(RuntimeWarning, match="checkpoints/2 is damaged"):
    run(cfg, log=logs.append)
  assert any("resumed from" in line and "/1 (step 1" in line for line in logs), logs
  assert os.listdir(os.path.join(cfg.workdir, "checkpoints_damaged"))[0].startswith("2-")
  ref = _comparable(read(os.path.join(done_run.workdir, "metrics.jsonl")))
  assert _comparable(read(os.path.join(cfg.workdir, "metrics.jsonl"))) == ref


def test_torn_last_metric_line_does_not_stop_a_resume(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  path = os.path.join(cfg.workdir, "metrics.jsonl")
  before = read(path)
  with open(path, "a") as f:
    f.write('{"step": 3, "reward_mean": 0.')
  with pytest.warns(RuntimeWarning, match="torn last line"):
    run(cfg, **QUIET)
  assert read(path) == before


def test_metrics_without_checkpoints_need_overwrite_and_are_moved_aside(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  shutil.rmtree(os.path.join(cfg.workdir, "checkpoints"))
  before = open(os.path.join(cfg.workdir, "metrics.jsonl")).read()
  with pytest.raises(ValueError, match="--workdir: .* holds metrics of an earlier run "
                                       ".*pass --overwrite"):
    run(cfg, **QUIET)
  assert open(os.path.join(cfg.workdir, "metrics.jsonl")).read() == before
  run(cfg.replace(overwrite=True), **QUIET)
  (moved,) = os.listdir(os.path.join(cfg.workdir, "previous"))
  assert open(os.path.join(cfg.workdir, "previous", moved, "metrics.jsonl")).read() == before
  # The fresh run from step 0 reproduces the earlier one.
  assert _comparable(read(os.path.join(cfg.workdir, "metrics.jsonl"))) == \
      _comparable(read(os.path.join(done_run.workdir, "metrics.jsonl")))


def test_a_second_run_in_a_locked_workdir_is_refused(done_run, tmp_path):
  from jetrl.train.workdir import WorkdirLock
  cfg = copy_run(done_run, tmp_path)
  with WorkdirLock(cfg.workdir):
    with pytest.raises(ValueError, match="--workdir: .* is in use by another run"):
      run(cfg, **QUIET)


def test_a_run_whose_updates_are_all_skipped_stops(tmp_path, monkeypatch):
  """A NaN in the optimizer state: every update is skipped; the run stops, nothing is saved."""
  from jetrl.train import loop
  from jetrl.train.skips import SkippedUpdatesError

  original = loop.init_train_state

  def poisoned(params, ucfg):
    state = original(params, ucfg)
    return state._replace(opt_state=jax.tree_util.tree_map(
        lambda x: x * jnp.nan if x.ndim == 2 else x, state.opt_state))

  monkeypatch.setattr(loop, "init_train_state", poisoned)
  cfg = TrainConfig(**dict(TINY, ckpt_every=10, max_skipped_steps=2), recipe="bf16",
                    workdir=str(tmp_path))
  with pytest.raises(SkippedUpdatesError, match=r"stopped at step 2: every update of the last "
                                                r"2 steps \(1\.\.2\) was skipped"):
    run(cfg, **QUIET)
  assert [r["skipped_updates"] for r in read(tmp_path / "metrics.jsonl")] == [1.0, 1.0]
  assert not os.listdir(tmp_path / "checkpoints")


def test_sft_checkpoints_periodically_and_resumes_exactly(tmp_path):
  from jetrl.train import SFTConfig, run_sft
  from jetrl.train.checkpoint import Checkpointer
  sft = SFTConfig(model="tiny", n_layers=1, task="addition", difficulty=1, length=2, steps=4,
                  batch_size=4, max_new_tokens=40, eval_size=4, ckpt_every=2,
                  workdir=str(tmp_path / "a"))
  run_sft(sft, **QUIET)
  assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["2", "4"]
  # Killed after checkpoint 2: its checkpoint and a torn metric line are all that is left.
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  os.remove(tmp_path / "b" / "sft_summary.json")
  (tmp_path / "b" / "sft_metrics.jsonl").write_text('{"step": 4, "lo')
  logs = []
  with pytest.warns(RuntimeWarning, match="torn"):
    run_sft(dataclasses.replace(sft, workdir=str(tmp_path / "b")), log=logs.append)
  assert "resumed SFT at step 2" in logs
  assert read(tmp_path / "b" / "sft_metrics.jsonl") == read(tmp_path / "a" / "sft_metrics.jsonl")
  states = []
  for d in ("a", "b"):
    ck = Checkpointer(str(tmp_path / d))
    states.append(ck._mngr.restore(4).state["params"])
    ck.close()
  for x, y in zip(jax.tree_util.tree_leaves(states[0]), jax.tree_util.tree_leaves(states[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The RL warm start reads the finished run's params (verified against their checksums).
  from jetrl.train.checkpoint import load_params_from
  warm = load_params_from(str(tmp_path / "b"), states[0], log=lambda *a: None)
  for x, y in zip(jax.tree_util.tree_leaves(warm), jax.tree_util.tree_leaves(states[0])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # an SFT run that has not finished
  with pytest.raises(ValueError, match="--init_from: the SFT run in .* stopped at step 2 of 4"):
    load_params_from(str(tmp_path / "b"), states[0], log=lambda *a: None)


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


# The rest of the reproductions are checked in-process (tests/train/test_validation.py); these
# show that the command line turns checks made by validate() and at start-up (devices, memory)
# into flag errors without a traceback.
@pytest.mark.parametrize("flag,value,message", [
    ("seed", str(2 ** 64), "--seed: must be in [0, 4294967295]"),
    ("workdir", "{tmp}/afile", "--workdir: "),
    ("mesh", "data:3", "--mesh: mesh 'data:3': axis sizes"),
    ("prompts_per_step", "100000000", "--prompts_per_step / --group_size / --max_new_tokens: "
                                      "one step needs at least"),
])
def test_reproduced_bad_flags_fail_fast_naming_the_flag(tmp_path, flag, value, message):
  (tmp_path / "afile").write_text("x")
  kw = {"workdir": tmp_path / "w", flag: value.format(tmp=tmp_path)}
  t0 = time.time()
  out = subprocess.run(_train_cmd(kw.pop("workdir"), **kw), capture_output=True, text=True,
                       timeout=120)
  assert out.returncode != 0
  assert message in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / "w" / "metrics.jsonl").exists()
  assert not (tmp_path / "checkpoints").exists()
  assert time.time() - t0 < 60, "validation must happen before any compilation"


def test_every_config_field_is_a_flag():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--helpfull"],
                       capture_output=True, text=True, timeout=120)
  import dataclasses
  for f in dataclasses.fields(TrainConfig):
    assert f"--{f.name}:" in out.stdout or f"--[no]{f.name}:" in out.stdout, f.name
