"""experiments/demo.py's command line: experiments/train.py's flags (named by config path) plus
the warm start's, parsed into the two runs' configs; its defaults are `make demo`'s. No run."""

import importlib.util
import subprocess
import sys

import pytest
from absl import flags

from jetrl.config import ConfigError
from jetrl.config.flags import config_from_flags, define_flags, flag_specs, load_config_file
from jetrl.rl import OptimizerConfig
from jetrl.sampling import GenerationConfig, SamplingConfig
from jetrl.train import CheckpointConfig, EvalConfig, SFTConfig, TaskConfig, TrainConfig


@pytest.fixture(scope="module")
def demo(root):
  if "demo_script" not in sys.modules:
    spec = importlib.util.spec_from_file_location("demo_script", root / "experiments" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_script"] = module  # before it runs: its dataclasses look themselves up
    spec.loader.exec_module(module)
  return sys.modules["demo_script"]


def parse(demo, argv):
  default = demo.get_config()
  fv = flags.FlagValues()
  define_flags(default, fv, exclude=demo.EXCLUDE)
  fv(["demo.py", *argv])
  return config_from_flags(default, fv, exclude=demo.EXCLUDE)


def test_defaults_are_make_demos_runs(demo, root):
  cfg = parse(demo, [])
  task = TaskConfig(name="addition", difficulty=1, length=3)
  # The two runs of `make demo`: the answer-noise warm start, then the study's RL setting.
  assert demo.sft_config(cfg) == SFTConfig(
    task=task,
    steps=200,
    answer_noise=0.5,
    sampling=GenerationConfig(max_new_tokens=64),
    eval=EvalConfig(every=None, size=256),
    seed=0,
    workdir="runs/demo/sft",
  )
  assert demo.rl_config(cfg) == TrainConfig(
    task=task,
    recipe="jet",
    init_from="runs/demo/sft",
    steps=30,
    seed=0,
    sampling=SamplingConfig(max_new_tokens=64, temperature=0.5, n=8),
    optimizer=OptimizerConfig(lr=5e-5),
    eval=EvalConfig(every=10, size=256),
    checkpoint=CheckpointConfig(every=10),
    workdir="runs/demo/rl",
  )
  assert cfg.keep is False
  # ... which are the example config files its docstring names.
  configs = root / "experiments" / "configs"
  sft = load_config_file(str(configs / "addition_sft.py"), SFTConfig())
  rl = load_config_file(str(configs / "addition_jet.py"), TrainConfig())
  assert demo.sft_config(cfg) == sft.replace(workdir="runs/demo/sft")
  assert demo.rl_config(cfg) == rl.replace(workdir="runs/demo/rl", init_from="runs/demo/sft")


def test_flags_set_the_rl_run_and_what_the_warm_start_shares(demo):
  cfg = parse(
    demo,
    [
      "--workdir=/tmp/d",
      "--keep",
      "--steps=80",
      "--recipe=bf16",
      "--seed=3",
      "--optimizer.lr=1e-4",
      "--sampling.temperature=0.9",
      "--sampling.max_new_tokens=48",
      "--eval.size=32",
      "--eval.every=20",
      "--task.length=2",
      "--model.n_layers=1",
      "--sft.steps=20",
      "--sft.batch_size=8",
      "--sft.optimizer.lr=2e-3",
    ],
  )
  assert cfg.keep is True
  rl, sft = demo.rl_config(cfg), demo.sft_config(cfg)
  assert (rl.workdir, rl.init_from) == ("/tmp/d/rl", "/tmp/d/sft")
  assert (rl.steps, rl.recipe, rl.seed, rl.optimizer.lr) == (80, "bf16", 3, 1e-4)
  assert rl.optimizer.warmup_steps == 0 and rl.optimizer.schedule == "constant"  # the demo's
  assert (rl.sampling.temperature, rl.sampling.max_new_tokens, rl.sampling.n) == (0.9, 48, 8)
  assert (rl.eval.size, rl.eval.every, rl.task.length, rl.model.n_layers) == (32, 20, 2, 1)
  assert (sft.workdir, sft.steps, sft.batch_size, sft.seed) == ("/tmp/d/sft", 20, 8, 3)
  assert sft.answer_noise == 0.5  # not given: the demo's
  assert sft.optimizer == OptimizerConfig(
    lr=2e-3, schedule="cosine", warmup_steps=20, end_lr_ratio=0.05
  )  # the SFT schedule, its lr changed
  assert (sft.sampling.max_new_tokens, sft.task.length, sft.model.n_layers) == (48, 2, 1)
  assert (sft.eval.size, sft.eval.every) == (32, None)  # evaluated at its end only
  assert sft.recipe == "bf16" and sft.task.name == "addition"


def test_flag_names_and_errors(demo):
  names = {s.path for s in flag_specs(demo.get_config(), exclude=demo.EXCLUDE)}
  assert "init_from" not in names  # the RL run starts from the warm start
  train_names = {s.path for s in flag_specs(TrainConfig())} - {"init_from"}
  assert train_names | {"keep", "sft.steps", "sft.batch_size", "sft.optimizer.lr"} <= names
  # Every old flag names a flag that exists.
  assert {v for v in demo.RENAMED.values()} <= names
  with pytest.raises(ConfigError, match="sft.steps: must be in"):
    parse(demo, ["--sft.steps=0"])
  with pytest.raises(ConfigError, match="sampling.temperature: must be > 0"):
    parse(demo, ["--sampling.temperature=0"])


def test_an_old_flag_names_its_new_one_and_nothing_is_written(root, tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      str(root / "experiments" / "demo.py"),
      f"--workdir={tmp_path / 'demo'}",
      "--rl_steps=5",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 2 and "--rl_steps is now --steps" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "demo").exists()


def test_a_rerun_moves_the_earlier_demo_aside_and_says_so(demo, tmp_path):
  work = tmp_path / "demo"
  lines = []
  cfg = parse(demo, [f"--workdir={work}"])
  assert demo.set_aside(cfg, lines.append) is None  # nothing there yet
  for half in ("sft", "rl"):
    (work / half).mkdir(parents=True)
    (work / half / "metrics.jsonl").write_text('{"step": 1}\n')
  (work / "notes.txt").write_text("mine")
  assert demo.set_aside(parse(demo, [f"--workdir={work}", "--keep"]), lines.append) is None
  assert lines == [] and (work / "rl" / "metrics.jsonl").exists()
  dest = demo.set_aside(cfg, lines.append)
  assert lines == [
    f"an earlier demo run in {work} was moved to {dest} (not deleted; --keep resumes it instead)"
  ]
  assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "previous"]
  for half in ("sft", "rl"):
    assert (tmp_path / dest / half / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_closing_lines_list_the_warm_starts_plot_too(demo):
  rl = demo.rl_config(parse(demo, ["--workdir=w"]))
  warm = {"plots": ["w/sft/plots/sft.png"]}
  summary = {"eval_before": 0.5, "eval_after": 0.625, "plots": ["w/rl/plots/reward.png"]}
  assert demo.report(rl, warm, summary).splitlines() == [
    "held-out greedy accuracy (256 problems): before RL 0.500, after RL 0.625 (+12.5 points)",
    "metrics: w/rl/metrics.jsonl",
    "plots:   w/sft/plots/sft.png",
    "         w/rl/plots/reward.png",
  ]
  # The warm start's own evaluation is the same weights under its recipe's rollout precision.
  warm = dict(warm, eval_accuracy=0.4375, recipe="bf16")
  assert demo.report(rl, warm, summary).splitlines()[1] == (
    "(the warm start's own 0.438 is the same weights sampled under bf16's rollout precision; "
    "before RL is under jet's)"
  )
