"""The RL runner end to end: every recipe, metrics fields, kill and resume, damaged and foreign
checkpoints, the workdir rules, the skipped-updates stop, SFT resume."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import quiet
from jetrl.train import Hook, run
from jetrl.train.checkpoint import meta_digest

STEP_FIELDS = [
  "reward_mean",
  "accuracy",
  "response_length",
  "entropy",
  "loss",
  "grad_norm",
  "learning_rate",
  "agree/abs_diff_mean",
  "agree/abs_diff_max",
  "agree/kl_k3",
  "agree/ratio_out_frac",
  "agree/seq_abs_sum_mean",
  "agree/bin_abs_diff_mean",
  "skipped_updates",
  "time/rollout",
  "time/reward",
  "time/update",
  "time/compiled",
  "tokens_per_s/rollout",
]


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _comparable(recs):
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in recs]


@pytest.mark.slow
# The recipes whose rollout and training differ (bf16 both ways, FP8 rollout only, FP8 both).
# fp32 and fp8_tensor change only the precision object the same code paths receive (their
# forward and gradients: tests/models/test_model_precision.py, tests/precision); jet_exact's
# sampler-update loop (zero mismatch at every step) is tests/sampling/test_exact_rollout.py.
@pytest.mark.parametrize("recipe", ["bf16", "fp8_rollout", "jet"])
def test_short_run_under_recipe(tmp_path, recipe, tiny_train_config):
  jet = recipe == "jet"
  cfg = tiny_train_config(tmp_path, recipe=recipe, logging={"plots": jet, "tensorboard": jet})
  summary = run(cfg, log=quiet)
  recs = read(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2]
  assert [r["time/compiled"] for r in recs][1] == 0.0
  for r in recs:
    for k in STEP_FIELDS:
      assert k in r, k
      assert np.all(np.isfinite(np.asarray(r[k], float))), (k, r[k])
    assert r["learning_rate"] == pytest.approx(1e-4)
    assert "kl" not in r  # no KL penalty, so no reference to measure a KL against
  evals = read(tmp_path / "eval.jsonl")
  assert [e["step"] for e in evals] == [0, 2]
  assert summary["eval_before"] is not None and summary["skipped_updates"] == 0
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["recipe"] == recipe and saved["sampling"]["n"] == 2
  if jet:
    names = sorted(os.path.basename(p) for p in summary["plots"])
    assert names == ["agreement.png", "agreement_by_position.png", "reward.png", "time.png"]
    assert all(os.path.getsize(p) > 1000 for p in summary["plots"])
    (events,) = glob.glob(str(tmp_path / "tb" / "events*"))
    data = open(events, "rb").read()
    for tag in (b"reward_mean", b"learning_rate", b"agree/abs_diff_mean", b"eval/accuracy"):
      assert tag in data, tag


def _cli(root, *args, env=None):
  return subprocess.run(
    [sys.executable, str(root / "experiments" / "train.py"), *args],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )


def _flags(cfg) -> list[str]:
  """The command-line flags of a config (every flag whose value differs from the default)."""
  from jetrl.config import leaf_paths
  from jetrl.config.flags import flag_specs
  from jetrl.train import TrainConfig

  values = leaf_paths(cfg)
  out = []
  for spec in flag_specs(TrainConfig()):
    value = values[spec.path]
    if value != spec.default:
      text = "none" if value is None else str(value).lower() if isinstance(value, bool) else value
      out.append(f"--{spec.path}={text}")
  return out


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(tmp_path, root, tiny_train_config):
  # The three processes share a compilation cache: the first compiles, the others reuse.
  env = dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  ref_dir, dir_ = tmp_path / "ref", tmp_path / "killed"
  flags = _flags(tiny_train_config("x", recipe="jet", steps=4, checkpoint={"every": 2}))
  flags = [f for f in flags if not f.startswith("--workdir")]
  out = _cli(root, f"--workdir={ref_dir}", *flags, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  proc = subprocess.Popen(
    [sys.executable, str(root / "experiments" / "train.py"), f"--workdir={dir_}", *flags],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  ckpt = dir_ / "checkpoints" / "2"
  deadline = time.time() + 600
  while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)  # mid-run: after checkpoint 2 appeared, before the end
  proc.wait()
  assert ckpt.exists(), "the run never reached its first checkpoint"
  out = _cli(root, f"--workdir={dir_}", *flags, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from" in out.stdout
  ref, got = _comparable(read(ref_dir / "metrics.jsonl")), _comparable(read(dir_ / "metrics.jsonl"))
  assert [r["step"] for r in got] == list(range(1, 5))
  assert got == ref
  assert read(ref_dir / "eval.jsonl")[-1] == read(dir_ / "eval.jsonl")[-1]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, tiny_train_config):
  """A finished 2-step bf16 run (checkpoints 1 and 2); tests work on copies of it."""
  cfg = tiny_train_config(tmp_path_factory.mktemp("done") / "run")
  run(cfg, log=quiet)
  return cfg


def copy_run(cfg, tmp_path):
  dest = tmp_path / "run"
  shutil.copytree(cfg.workdir, dest)
  return cfg.replace(workdir=str(dest))


def test_checkpoint_from_other_config_is_refused(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  with pytest.raises(
    ValueError,
    match=r"(?s)written with other settings.*"
    r"--recipe: checkpoint has 'bf16', this run has 'jet'.*"
    r"--optimizer.lr: checkpoint has 0.0001, this run has 0.001",
  ):
    run(cfg.replace(recipe="jet", optimizer={"lr": 1e-3}), log=quiet)
  # A checkpoint written by a configuration with other fields (an older layout) is named too
  # (its metadata rewritten with its own checksum, as the version that wrote it would have).
  meta = os.path.join(cfg.workdir, "checkpoints", "2", "meta", "metadata")
  saved = json.load(open(meta))

  def refused(match):
    json.dump(dict(saved, meta_checksum=meta_digest(saved)), open(meta, "w"))
    with pytest.raises(ValueError, match=match):
      run(cfg, log=quiet)

  saved["config"]["lr"] = 1e-4
  refused(r"--lr: the checkpoint has this field \(0.0001\), this version has no such field")
  # A checkpoint from when the PPO ratio's old log-probs defaulted to the rollout's.
  del saved["config"]["lr"]
  saved["config"]["update"]["old_logp"] = "rollout"
  refused(
    r"(?s)--update.old_logp: checkpoint has 'rollout', this run has 'auto'.*"
    r"pass --update.old_logp=rollout to resume this run as it was"
  )
  # One from when they defaulted to a recomputed pre-update forward.
  saved["config"]["update"]["old_logp"] = "recompute"
  refused(
    r"(?s)--update.old_logp: checkpoint has 'recompute', this run has 'auto'.*"
    r"pass --update.old_logp=recompute to resume this run as it was"
  )


def test_damaged_latest_checkpoint_resumes_from_the_one_before(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  files = sorted(
    glob.glob(f"{cfg.workdir}/checkpoints/2/state/**/d/*", recursive=True), key=os.path.getsize
  )
  data = bytearray(open(files[-1], "rb").read())
  data[len(data) // 2] ^= 0x40  # one flipped bit
  open(files[-1], "wb").write(bytes(data))
  logs = []
  # The log, not the warnings registry: Python's warning filters are process-wide state that
  # another thread's `catch_warnings` can swap out for a moment, and one full-suite run saw
  # this warning go unrecorded. The warning itself: test_checkpoint_integrity.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    run(cfg, log=logs.append)
  assert any("warning:" in line and "checkpoints/2 is damaged" in line for line in logs), logs
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
    run(cfg, log=quiet)
  assert read(path) == before


class _StopAfter(Hook):
  """Records what it sees after each step, and stops the run after step `stop`."""

  every = 1

  def __init__(self, workdir, stop):
    self.workdir, self.stop, self.seen = workdir, stop, []

  def __call__(self, step, loop):
    ckpts = sorted(os.listdir(os.path.join(self.workdir, "checkpoints")))
    self.seen.append((step, read(os.path.join(self.workdir, "metrics.jsonl"))[-1]["step"], ckpts))
    if step == self.stop:
      raise KeyboardInterrupt(f"stopped after step {step}")


def test_a_callers_hook_runs_after_the_steps_record_and_checkpoint(done_run, tmp_path):
  """run(..., hooks=[h]): h runs after each step once its record and checkpoint are on disk;
  what it raises ends the run there, and a rerun resumes to the uninterrupted run's records."""
  cfg = copy_run(done_run, tmp_path)
  shutil.rmtree(cfg.workdir)
  with pytest.raises(TypeError, match="hooks must be jetrl.train.hooks.Hook instances"):
    run(cfg, log=quiet, hooks=[lambda step, loop: None])
  assert not os.path.exists(cfg.workdir)  # refused before anything started
  hook = _StopAfter(cfg.workdir, stop=1)
  with pytest.raises(KeyboardInterrupt, match="stopped after step 1"):
    run(cfg, log=quiet, hooks=[hook])
  assert hook.seen == [(1, 1, ["1"])]
  assert not os.path.exists(os.path.join(cfg.workdir, "summary.json"))
  logs = []
  run(cfg, log=logs.append)
  assert any("resumed from" in line and "(step 1" in line for line in logs), logs
  ref = _comparable(read(os.path.join(done_run.workdir, "metrics.jsonl")))
  assert _comparable(read(os.path.join(cfg.workdir, "metrics.jsonl"))) == ref


def test_metrics_without_checkpoints_need_overwrite_and_are_moved_aside(done_run, tmp_path):
  cfg = copy_run(done_run, tmp_path)
  shutil.rmtree(os.path.join(cfg.workdir, "checkpoints"))
  before = open(os.path.join(cfg.workdir, "metrics.jsonl")).read()
  with pytest.raises(
    ValueError, match="--workdir: .* holds metrics of an earlier run .*pass --overwrite"
  ):
    run(cfg, log=quiet)
  # A rerun whose own first checkpoint lies past every record is judged by the earlier run's
  # saved config (a checkpoint every step), not by its own flags.
  with pytest.raises(
    ValueError, match=r"first checkpoint was due at step 1 \(its config.json\); pass --overwrite"
  ):
    run(cfg.replace(steps=5, checkpoint={"every": 5}), log=quiet)
  assert open(os.path.join(cfg.workdir, "metrics.jsonl")).read() == before
  run(cfg.replace(overwrite=True), log=quiet)
  (moved,) = os.listdir(os.path.join(cfg.workdir, "previous"))
  assert open(os.path.join(cfg.workdir, "previous", moved, "metrics.jsonl")).read() == before
  # The fresh run from step 0 reproduces the earlier one.
  assert _comparable(read(os.path.join(cfg.workdir, "metrics.jsonl"))) == _comparable(
    read(os.path.join(done_run.workdir, "metrics.jsonl"))
  )


def test_a_second_run_in_a_locked_workdir_is_refused(done_run, tmp_path):
  from jetrl.train.workdir import WorkdirLock

  cfg = copy_run(done_run, tmp_path)
  with WorkdirLock(cfg.workdir):
    with pytest.raises(ValueError, match="--workdir: .* is in use by another run"):
      run(cfg, log=quiet)


def test_a_run_whose_updates_are_all_skipped_stops(tmp_path, monkeypatch, tiny_train_config):
  """A NaN in the optimizer state: every update is skipped; the run stops, nothing is saved."""
  from jetrl.train import loop
  from jetrl.train.skips import SkippedUpdatesError

  original = loop.init_train_state

  def poisoned(params, *args):
    state = original(params, *args)
    return state._replace(
      opt_state=jax.tree_util.tree_map(lambda x: x * jnp.nan if x.ndim == 2 else x, state.opt_state)
    )

  monkeypatch.setattr(loop, "init_train_state", poisoned)
  cfg = tiny_train_config(tmp_path, max_skipped_steps=2, checkpoint={"every": 10})
  with pytest.raises(
    SkippedUpdatesError,
    match=r"stopped at step 2: every update of the last "
    r"2 steps \(1\.\.2\) was skipped",
  ):
    run(cfg, log=quiet)
  assert [r["skipped_updates"] for r in read(tmp_path / "metrics.jsonl")] == [1.0, 1.0]
  assert not os.listdir(tmp_path / "checkpoints")


# Runs an entry point (argv[1], its flags after it) with the optimizer state poisoned by a NaN,
# so that every update is skipped.
POISONED_ENTRY = """
import runpy, sys
import jax, jax.numpy as jnp
from jetrl.train import loop
original = loop.init_train_state
def poisoned(params, *args):
  state = original(params, *args)
  nan = lambda x: x * jnp.nan if x.ndim == 2 else x
  return state._replace(opt_state=jax.tree_util.tree_map(nan, state.opt_state))
loop.init_train_state = poisoned
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_train_py_exits_1_with_one_line_when_every_update_is_skipped(
  tmp_path, root, tiny_train_config
):
  cfg = tiny_train_config(
    tmp_path / "run", steps=3, max_skipped_steps=2, checkpoint={"every": 10}, eval={"size": 2}
  )
  out = subprocess.run(
    [sys.executable, "-c", POISONED_ENTRY, str(root / "experiments" / "train.py"), *_flags(cfg)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 1, out.stderr[-3000:]
  (line,) = [line for line in out.stderr.splitlines() if "error:" in line]
  assert line.startswith(
    "train.py: error: stopped at step 2: every update of the last 2 steps (1..2) was skipped"
  ), out.stderr[-3000:]
  assert line.endswith("and the initial params (--model.name / --init_from).")
  assert "Traceback" not in out.stderr
  assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
  assert not os.listdir(tmp_path / "run" / "checkpoints")


def test_sft_checkpoints_periodically_and_resumes_exactly(
  tmp_path, tiny_sft_config, tiny_train_config
):
  from jetrl.train import run_sft
  from jetrl.train.checkpoint import Checkpointer, load_params_from

  sft = tiny_sft_config(tmp_path / "a", checkpoint={"every": 2}, logging={"every": 1})
  summary = run_sft(sft, log=quiet)
  assert summary["plots"] == [str(tmp_path / "a" / "plots" / "sft.png")]
  assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["2", "4"]
  lrs = [r["learning_rate"] for r in read(tmp_path / "a" / "sft_metrics.jsonl")]
  # Warmup over the 4 steps the run has (the schedule's warmup is cut to the run's length).
  assert lrs == pytest.approx([0.0, 1e-3 / 4, 2e-3 / 4, 3e-3 / 4])
  # Killed after checkpoint 2: its checkpoint and a torn metric line are all that is left.
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  os.remove(tmp_path / "b" / "sft_summary.json")
  (tmp_path / "b" / "sft_metrics.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in read(tmp_path / "a" / "sft_metrics.jsonl")[:2])
    + '{"step": 3, "lo'
  )
  logs = []
  with pytest.warns(RuntimeWarning, match="torn"):
    run_sft(sft.replace(workdir=str(tmp_path / "b")), log=logs.append)
  assert f"resumed SFT at step 2 from {tmp_path / 'b' / 'checkpoints' / '2'}" in logs
  assert logs.count("compiling the SFT step (first step only)...") == 1  # before step 3
  assert read(tmp_path / "b" / "sft_metrics.jsonl") == read(tmp_path / "a" / "sft_metrics.jsonl")
  states = []
  for d in ("a", "b"):
    ck = Checkpointer(str(tmp_path / d))
    states.append(ck._mngr.restore(4).state["params"])
    ck.close()
  for x, y in zip(jax.tree_util.tree_leaves(states[0]), jax.tree_util.tree_leaves(states[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The RL warm start reads the finished run's params (verified against their checksums).
  warm = load_params_from(str(tmp_path / "b"), states[0], log=quiet)
  for x, y in zip(jax.tree_util.tree_leaves(warm), jax.tree_util.tree_leaves(states[0])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # an SFT run that has not finished
  with pytest.raises(ValueError, match="--init_from: the SFT run in .* stopped at step 2 of 4"):
    load_params_from(str(tmp_path / "b"), states[0], log=quiet)
  # An RL run pointed at an SFT workdir is told to warm-start from it instead.
  with pytest.raises(ValueError, match="holds checkpoints of an SFT run .* pass it as --init_from"):
    run(tiny_train_config(tmp_path / "a"), log=quiet)
