"""The entry points' command line: flags named by config path, --config files with flags on
top, flag errors before anything compiles, start-up refusals, renamed flags, grouped --help,
a quiet console. Parsing is checked in-process; one subprocess per kind of exit."""

import json
import os
import subprocess
import sys
import time

import pytest
from absl import flags

from conftest import quiet, parse_flags
from jetrl.config import FlagError
from jetrl.config.flags import config_from_flags, define_flags
from jetrl.study import StudyConfig
from jetrl.train import SFTConfig, TrainConfig, run
from jetrl.config import former_names, resumable_paths
from jetrl.train.cli import parse_argv, usage


parse = parse_flags


def test_flags_are_field_paths_with_optional_tuple_and_choice_values(tmp_path):
  cfg = parse(
    [
      f"--workdir={tmp_path}",
      "--optimizer.lr=3e-5",
      "--sampling.temperature=0.7",
      "--sampling.n=4",
      "--model.n_layers=1",
      "--update.clip_high=0.28",
      "--update.aggregation=token",
      "--logging.tensorboard=false",
      "--eval.every=none",
      "--init_from=",
      "--recipe=bf16",
    ]
  )
  assert cfg.optimizer.lr == 3e-5 and cfg.sampling.temperature == 0.7 and cfg.sampling.n == 4
  assert cfg.model.n_layers == 1 and cfg.update.clip_high == 0.28
  assert cfg.update.aggregation == "token" and cfg.logging.tensorboard is False
  assert cfg.eval.every is None and cfg.init_from is None and cfg.recipe == "bf16"
  # Flags not given keep the defaults of their node.
  assert cfg.optimizer.schedule == "constant" and cfg.update.clip_high is not None
  assert parse(["--update.clip_high=none"]).update.clip_high is None
  assert parse(["--sampling.top_k=none"]).sampling.top_k is None
  assert parse(["--sampling.top_k=40"]).sampling.top_k == 40
  # Tuples: comma-separated, each element checked.
  from jetrl.study import set_by_study

  fv = flags.FlagValues()
  grid = set_by_study(StudyConfig())
  define_flags(StudyConfig(), fv, exclude=grid)
  fv(
    [
      "prog",
      "--recipes=bf16, jet",
      "--corrected=jet",
      "--lengths=2,4",
      "--seeds=0,1",
      "--sft.optimizer.lr=2e-3",
    ]
  )
  study = config_from_flags(StudyConfig(), fv, exclude=grid)
  assert study.recipes == ("bf16", "jet") and study.corrected == ("jet",)
  assert [arm.label for arm in study.arms] == ["bf16", "jet", "jet+tis"]
  assert study.lengths == (2, 4)
  assert study.seeds == (0, 1) and study.sft.optimizer.lr == 2e-3
  assert "task.length" not in fv and "command" not in fv


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["--recipe=fp8"],
      "--recipe: 'fp8' is not accepted; choose one of ['fp32', 'bf16', "
      "'fp8_rollout', 'jet', 'fp8_tensor', 'jet_exact', 'fp8_rollout_tensor', "
      "'fp8_rollout_e5m2', 'jet_exact_rollout', 'jet_exact_train', "
      "'jet_exact_train_bf16_rollout', 'jet_exact_train_e5m2_rollout']",
    ),
    (["--sampling.n=1"], "--sampling.n: must be >= 2 for group-relative advantages"),
    (["--sampling.temperature=0"], "--sampling.temperature: must be > 0"),
    (
      ["--eval.temperature=1e-30"],
      "--eval.temperature: must be 0 or in [0.01, 100], got 1e-30",
    ),
    (["--sampling.temperature=1e-30"], "--sampling.temperature: must be 0 or in [0.01, 100]"),
    (["--sampling.temperature=101"], "--sampling.temperature: must be 0 or in [0.01, 100]"),
    (["--grad_fmt=e5m2", "--recipe=bf16"], "--grad_fmt: gradient format 'e5m2' needs a recipe"),
    (
      ["--kv_cache=fp8", "--recipe=bf16"],
      "--kv_cache: kv_cache 'fp8' needs a recipe with an FP8 rollout that takes it "
      "(fp8_rollout, jet, jet_exact); 'bf16' keeps",
    ),
    (["--kv_cache=bf16"], "--kv_cache: 'bf16' is not accepted; choose one of ['compute', 'fp8']"),
    (["--update.minibatches=3"], "--update.minibatches: prompts_per_step x sampling.n = 128 rows"),
    (["--task.name=chess"], "--task.name: 'chess' is not accepted"),
    (["--update.is_method=clip"], "--update.is_method: 'clip' is not accepted"),
    (["--seed=18446744073709551616"], "--seed: must be in [0, 4294967295]"),
    (["--optimizer.lr=nan"], "--optimizer.lr: must be a finite number in (0, 1], got nan"),
    (["--task.difficulty=100"], "--task.difficulty: must be in [1, 9], got 100"),
    (["--mesh=data:x"], "--mesh: "),
    (
      ["--sampling.top_k=0"],
      "--sampling.top_k: must be a positive number of tokens, or none for no top-k",
    ),
    (["--sampling.top_k=-1"], "--sampling.top_k: must be a positive number of tokens"),
    # the task node's own
    (
      ["--task.prompt_format=xml"],
      "--task.prompt_format: 'xml' is not accepted; choose one of ['plain', 'chat']",
    ),
    (
      ["--task.system_prompt=be brief"],
      "--task.system_prompt: is part of a chat prompt; pass --task.prompt_format=chat",
    ),
    (["--task.reward=score"], "--task.reward: reward 'score': expected 'path/to/file.py:function'"),
    (["--task.reward=r.py:not-a-name"], "--task.reward: reward 'r.py:not-a-name': expected"),
    (["--task.reward_timeout=0"], "--task.reward_timeout: must be in (0, 86400], got 0.0"),
    (["--task.name=chess"], "--task.name: 'chess' is not accepted; choose one of ['addition', "),
  ],
)
def test_bad_values_are_flag_errors(argv, message):
  with pytest.raises(FlagError) as e:
    parse(argv)
  assert str(e.value).startswith(message), str(e.value)


def test_the_fp8_kv_cache_flag_reaches_the_recipe():
  assert parse([]).precision_recipe.rollout.kv_cache == "compute"  # off by default
  jet = parse(["--kv_cache=fp8"]).precision_recipe  # jet: the training forward reads it too
  assert jet.train.kv_cache == "fp8" and jet.rollout == jet.train.forward
  fr = parse(["--kv_cache=fp8", "--recipe=fp8_rollout"]).precision_recipe
  assert fr.rollout.kv_cache == "fp8" and fr.train.kv_cache == "compute"
  assert "  --kv_cache=" in usage(TrainConfig(), "doc line")


def test_an_old_config_with_top_k_0_reads_as_none(tmp_path):
  """`sampling.top_k` 0 meant every token before the field became Optional: a config file or a
  checkpoint's config that stores it reads as None, so the run resumes."""
  from jetrl.train.resume import incompatible_fields

  old = TrainConfig().to_dict()
  old["sampling"]["top_k"] = 0
  (tmp_path / "config.json").write_text(json.dumps(old))
  assert parse([f"--config={tmp_path / 'config.json'}"]) == TrainConfig()
  assert incompatible_fields(json.loads(json.dumps(old)), TrainConfig()) == []
  assert incompatible_fields(old, TrainConfig().replace(sampling={"top_k": 5})) == [
    "--sampling.top_k: checkpoint has None, this run has 5"
  ]
  # A value that was never a legacy spelling still counts as a difference.
  old["sampling"]["top_k"] = 7
  assert incompatible_fields(old, TrainConfig()) == [
    "--sampling.top_k: checkpoint has 7, this run has None"
  ]


def test_an_old_sft_config_with_a_top_level_budget_reads_as_sampling_max_new_tokens():
  """SFT's generation budget was the top-level `max_new_tokens` before it became
  `sampling.max_new_tokens`, as in RL: a stored tree that has it (a checkpoint's config, a
  config file) reads it there, so an old SFT run resumes and a changed budget is named."""
  from jetrl.config import from_dict
  from jetrl.train.resume import incompatible_fields

  old = SFTConfig().to_dict()
  del old["sampling"]
  old["max_new_tokens"] = 48
  assert from_dict(SFTConfig, old).sampling.max_new_tokens == 48
  assert incompatible_fields(old, SFTConfig().replace(sampling={"max_new_tokens": 48})) == []
  assert incompatible_fields(old, SFTConfig()) == [
    "--sampling.max_new_tokens: checkpoint has 48, this run has 64"
  ]
  # Stored beside the new path, the old key is not read for it: it is reported.
  both = dict(SFTConfig().to_dict(), max_new_tokens=48)
  assert incompatible_fields(both, SFTConfig()) == [
    "--max_new_tokens: the checkpoint has this field (48), this version has no such field"
  ]


@pytest.mark.parametrize(
  "flag, value, message",
  [
    ("workdir", "{tmp}/afile", "--workdir: "),
    ("model.name", "/no/such/dir", "--model.name: '/no/such/dir' is none of the presets"),
    ("mesh", "data:3", "--mesh: mesh 'data:3': axis sizes"),
    (
      "prompts_per_step",
      "100000000",
      "--prompts_per_step / --sampling.n / --sampling.max_new_tokens: one step needs at least",
    ),
  ],
)
def test_start_up_refusals_name_the_flag_before_anything_is_written(tmp_path, flag, value, message):
  (tmp_path / "afile").write_text("x")
  argv = [
    f"--workdir={tmp_path / 'w'}",
    "--model.n_layers=1",
    f"--{flag}={value.format(tmp=tmp_path)}",
  ]
  t0 = time.time()
  with pytest.raises(FlagError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
    run(parse(argv), log=quiet)
  assert not (tmp_path / "w" / "metrics.jsonl").exists()
  assert not (tmp_path / "w" / "checkpoints").exists()
  assert time.time() - t0 < 60, "the checks come before any compilation"


def test_a_huge_evaluation_is_refused_at_start_up(tmp_path, tiny_train_config, tiny_sft_config):
  """--eval.samples completions of --eval.batch problems are one sampler call: RL, SFT and
  experiments/evaluate.py refuse one that cannot fit, in seconds, before anything is written."""
  from jetrl.train import run_sft
  from jetrl.train.evaluate import EvalRunConfig, run_eval

  huge = {"temperature": 0.5, "samples": 100_000_000}
  t0 = time.time()
  rl = tiny_train_config(tmp_path / "rl", eval=huge)
  with pytest.raises(
    FlagError,
    match=r"^--eval.batch / --eval.samples / --sampling.max_new_tokens: one evaluation call "
    r"needs at least .* GiB \(evaluation KV cache",
  ):
    run(rl, log=quiet)
  # The same flags in every run: the budget is --sampling.max_new_tokens in SFT and eval too.
  sft = tiny_sft_config(tmp_path / "sft", eval=huge)
  same = r"^--eval.batch / --eval.samples / --sampling.max_new_tokens: one evaluation call"
  with pytest.raises(FlagError, match=same):
    run_sft(sft, log=quiet)
  with pytest.raises(FlagError, match=same):
    run_eval(EvalRunConfig(model=rl.model, task=rl.task, eval=rl.eval), log=quiet)
  for name in ("rl", "sft"):  # nothing written: the new workdir, its lock released, is gone
    assert not (tmp_path / name).exists()
  assert time.time() - t0 < 60, "the checks come before any compilation"
  # Greedy evaluation draws one completion per problem: --eval.samples does not count.
  assert rl.replace(eval={"temperature": 0.0}).eval.rows == 4
  assert rl.eval.rows == 4 * 100_000_000


def test_config_files_python_json_yaml_with_flags_on_top(tmp_path, root):
  py = root / "experiments" / "configs" / "addition_jet.py"
  cfg = parse([f"--config={py}", f"--workdir={tmp_path}", "--recipe=bf16", "--steps=7"])
  assert (cfg.recipe, cfg.steps, cfg.optimizer.lr, cfg.sampling.temperature) == (
    "bf16",
    7,
    5e-5,
    0.5,
  )
  assert cfg.task.length == 3 and cfg.eval.size == 256
  sft = parse([f"--config={root / 'experiments' / 'configs' / 'addition_sft.py'}"], SFTConfig())
  assert sft.steps == 200 and sft.task.length == 3 and sft.optimizer.lr == 1e-3
  assert sft.answer_noise == 0.5
  # A run's config.json is a config file: the same run again, flags on top.
  (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
  again = parse([f"--config={tmp_path / 'config.json'}", "--sampling.n=4"])
  assert again == cfg.replace(sampling={"n": 4})
  (tmp_path / "c.yaml").write_text("recipe: jet\noptimizer:\n  lr: 0.001\nsampling:\n  n: 2\n")
  y = parse([f"--config={tmp_path / 'c.yaml'}"])
  assert (y.recipe, y.optimizer.lr, y.sampling.n, y.steps) == ("jet", 1e-3, 2, 50)
  for text, message in (
    ("optimizer:\n  rate: 1\n", "--config: .*optimizer.rate: no such field"),
    ("optimizer:\n  lr: -1\n", r"--config: .*optimizer.lr: must be in \(0, 1\]"),
    ("recipe: [jet\n", "--config: .*YAMLError|--config: .*ScannerError|--config: .*ParserError"),
  ):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(FlagError, match=message):
      parse([f"--config={tmp_path / 'bad.yaml'}"])
  (tmp_path / "wrong.py").write_text(
    "from jetrl.train import SFTConfig\ndef get_config():\n  return SFTConfig()\n"
  )
  with pytest.raises(FlagError, match="returned a SFTConfig; this program takes a TrainConfig"):
    parse([f"--config={tmp_path / 'wrong.py'}"])


def test_flags_that_do_not_parse_and_config_keys_that_are_no_field(tmp_path):
  fv = flags.FlagValues()
  names = ["config", *define_flags(TrainConfig(), fv)]
  for arg, message in (
    ("--optimizer.lrr=1", r"^--optimizer.lrr: no such flag; did you mean --optimizer.lr\? "),
    ("--samplingn=2", r"^--samplingn: no such flag; did you mean --sampling.n\? "),
    ("--zzz=2", r"^--zzz: no such flag; \S+ --help lists them$"),  # nothing close
    ("--optimizer.lr=abc", r"^--optimizer.lr: expected a number, got 'abc'$"),
    ("--sampling.n=x", r"^--sampling.n: expected an integer, got 'x'$"),
    ("--overwrite=maybe", r"^--overwrite: expected true or false, got 'maybe'$"),
    ("--nooverwrite=1", r"^--nooverwrite=1 does not take an argument$"),
  ):
    with pytest.raises(FlagError, match=message):
      parse_argv(["train.py", arg], fv, names)
  assert parse_argv(["train.py", "--sampling.n=4", "rest"], fv, names) == ["train.py", "rest"]
  # A config file's key typo: the closest field, and only the fields one sets (the sampler's
  # internal pad and stop ids are not offered).
  (tmp_path / "c.json").write_text('{"sampling": {"temprature": 0.5}}')
  with pytest.raises(FlagError) as e:
    parse_flags([f"--config={tmp_path / 'c.json'}"])
  assert str(e.value).startswith(
    f"--config: {tmp_path / 'c.json'}: sampling.temprature: no such field; did you mean "
    "'temperature'? SamplingConfig has ['max_new_tokens', 'n', "
  )
  assert "pad_id" not in str(e.value) and "stop_ids" not in str(e.value)


def test_help_lists_every_flag_grouped_by_config():
  text = usage(TrainConfig(), "doc line")
  for group in (
    "--model.*",
    "--task.*",
    "--sampling.*",
    "--optimizer.*",
    "--update.*",
    "--eval.*",
    "--checkpoint.*",
    "--logging.*",
    "--kernels.*",
  ):
    assert f"\n{group}:" in text, group
  from jetrl.config.flags import flag_specs

  for spec in flag_specs(TrainConfig()):
    assert f"  --{spec.path}=" in text, spec.path
  assert "--sampling.stop_ids" not in text  # filled in by the run, not a flag
  # Every old flag name maps to a flag that exists, and they are the names train.py had.
  names = {s.path for s in flag_specs(TrainConfig())}
  renamed = former_names(TrainConfig)
  assert set(renamed.values()) <= names
  assert renamed == OLD_TRAIN_FLAGS
  # The study holds the same nodes twice (its runs' and, under sft, its warm start's): an old
  # top-level name stays the top-level field's.
  study = former_names(StudyConfig)
  assert study["model"] == "model.name" and study["lr"] == "optimizer.lr"


# The flags of experiments/train.py before the configuration had nodes, and their new names.
OLD_TRAIN_FLAGS = {
  **{k: f"model.{v}" for k, v in {"model": "name", "n_layers": "n_layers"}.items()},
  **{k: f"task.{k}" for k in ("difficulty", "length", "data_path")},
  "task": "task.name",
  "lr": "optimizer.lr",
  "warmup_steps": "optimizer.warmup_steps",
  "schedule": "optimizer.schedule",
  "weight_decay": "optimizer.weight_decay",
  "max_grad_norm": "optimizer.max_grad_norm",
  "eval_size": "eval.size",
  "eval_every": "eval.every",
  "ckpt_every": "checkpoint.every",
  "keep_ckpts": "checkpoint.keep",
  "tensorboard": "logging.tensorboard",
  "plots": "logging.plots",
  "group_size": "sampling.n",
  "max_new_tokens": "sampling.max_new_tokens",
  "temperature": "sampling.temperature",
  "loss": "update.loss",
  "is_correction": "update.is_method",
  "is_cap": "update.is_cap",
  "old_logp": "update.old_logp",
  "clip_low": "update.clip_low",
  "clip_high": "update.clip_high",
  "kl_coef": "update.kl_coef",
  "entropy_coef": "update.entropy_coef",
  "dynamic_sampling": "update.dynamic_sampling",
  "overlong_buffer": "update.overlong_buffer",
  "mask_truncated": "update.mask_truncated",
  "ppo_epochs": "update.ppo_epochs",
  "minibatches": "update.minibatches",
  "micro_batches": "update.micro_batches",
  "master_dtype": "update.master_dtype",
}


def test_resumable_fields_are_the_ones_a_resume_may_change():
  """The fields marked resumable are those a resumed run may change (the lists from before
  they were marked on the fields): bookkeeping, evaluation cadence, checkpoints, logging."""
  common = {"workdir", "steps", "task.reward_timeout", "checkpoint", "logging", "mesh"}
  common |= {"max_skipped_steps", "overwrite", "allow_schedule_change", "kernels"}
  assert set(resumable_paths(TrainConfig)) == common | {"eval.every", "eval.batch"}
  assert set(resumable_paths(SFTConfig)) == common | {"eval"}


def test_command_line_errors_help_and_renamed_flags(tmp_path, root):
  """The entry point itself: exit code 2 and one message, no traceback."""
  script = str(root / "experiments" / "train.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # a CPU is all it needs, on any machine

  def train(*flags):
    cmd = [sys.executable, script, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)

  out = train(f"--workdir={tmp_path}", "--recipe=fp8")
  assert out.returncode == 2
  assert "error: --recipe: 'fp8' is not accepted" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "metrics.jsonl").exists()
  out = train(f"--workdir={tmp_path}", "--optimizer.lrr=1e-3")  # absl's parse: the same style
  assert out.returncode == 2 and "FATAL" not in out.stderr, out.stderr[-2000:]
  assert out.stderr.strip() == (
    "train.py: error: --optimizer.lrr: no such flag; did you mean --optimizer.lr? train.py "
    "--help lists them"
  )
  out = train(f"--workdir={tmp_path}", "--lr=1e-3")
  assert out.returncode == 2
  assert "--lr is now --optimizer.lr" in out.stderr, out.stderr[-2000:]
  out = train("--help")
  assert out.returncode == 0 and "--optimizer.lr=0.0001" in out.stdout
  assert "Try --helpfull" not in out.stdout and "--sampling.*:" in out.stdout
  out = train(f"--workdir={tmp_path}", "--kernels.decode_gemm=triton")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert "error: --kernels.decode_gemm: 'triton' is not accepted" in out.stderr
  # A JETRL_* variable gives a default: --help shows it; a bad one is named.
  env["JETRL_FUSED_MLP"] = "0"
  out = train("--help")
  assert out.returncode == 0 and "--kernels.fused_mlp=false" in out.stdout, out.stdout[-2000:]
  env["JETRL_FUSED_MLP"] = "yes"
  out = train(f"--workdir={tmp_path}")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert "error: JETRL_FUSED_MLP must be 0, 1 or unset" in out.stderr


def test_a_failing_reward_function_ends_the_command_in_one_line(tmp_path, root):
  """RewardError (a --task.reward function that cannot be used) is a failed run: exit code 1
  and its message, no traceback. RL: a function that raises on every batch stops the run at
  its third batch in a row (the evaluation before step 1, one problem a batch); SFT: a
  function returning the wrong number of values stops the evaluation at the end."""
  (tmp_path / "bad.py").write_text(
    "def raises(prompts, completions, answers):\n"
    "  return [1 / 0 for _ in completions]\n"
    "def short(prompts, completions, answers):\n"
    "  return [0.0]\n"
  )
  tiny = [
    "--model.n_layers=1",
    "--task.difficulty=1",
    "--task.length=1",
    "--eval.size=3",
    "--logging.tensorboard=false",
    "--logging.plots=false",
  ]
  runs = {
    "train.py": tiny
    + [
      f"--workdir={tmp_path / 'rl'}",
      f"--task.reward={tmp_path / 'bad.py'}:raises",
      "--eval.batch=1",
      "--steps=1",
      "--prompts_per_step=2",
      "--sampling.n=2",
      "--sampling.max_new_tokens=8",
    ],
    "sft.py": tiny
    + [
      f"--workdir={tmp_path / 'sft'}",
      f"--task.reward={tmp_path / 'bad.py'}:short",
      "--steps=1",
      "--batch_size=2",
      "--sampling.max_new_tokens=24",
    ],
  }
  procs = {  # both at once: most of their time is compiling, on one core each
    name: subprocess.Popen(
      [sys.executable, str(root / "experiments" / name), *argv],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),  # error handling: no GPU needed
    )
    for name, argv in runs.items()
  }
  want = {
    "train.py": f"train.py: error: reward '{tmp_path / 'bad.py'}:raises' failed on 3 batches in a "
    "row; the last: raised ZeroDivisionError: division by zero",
    "sft.py": f"sft.py: error: reward '{tmp_path / 'bad.py'}:short' returned 1 values for 3 "
    "completions; it must return one float per completion",
  }
  for name, proc in procs.items():
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (name, err[-3000:])
    assert "Traceback" not in err, (name, err[-3000:])
    assert err.strip().splitlines()[-1].startswith(want[name]), (name, err[-3000:])
  from jetrl.train.validation import checkpoint_steps

  assert checkpoint_steps(str(tmp_path / "rl")) == []  # stopped before step 1
  # SFT stopped at the evaluation after its step (which comes before the step's checkpoint).
  metrics = (tmp_path / "sft" / "sft_metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in metrics] == [1]
  assert checkpoint_steps(str(tmp_path / "sft")) == []


LOGGING_PROGRAM = """
import logging
from absl import logging as absl_logging
from jetrl.train import TrainConfig
from jetrl.train.cli import main

def run_fn(cfg):
  for name in ("orbax", "jax"):
    logging.getLogger(name).info("%s info line", name)
    logging.getLogger(name).warning("%s warning line", name)
  absl_logging.info("absl info line")
  levels = [logging.getLogger(n).getEffectiveLevel() for n in ("orbax", "jax", "absl")]
  print("levels", levels)

main(TrainConfig(), run_fn, doc="a tiny entry point")
"""


def test_third_party_info_logs_are_quiet_unless_verbosity_is_given(tmp_path):
  """Orbax's, JAX's and absl's INFO lines are off by default; --verbosity=0 (or -v=0) brings
  them back; warnings always show."""
  program = tmp_path / "prog.py"
  program.write_text(LOGGING_PROGRAM)
  argvs = [[], ["--verbosity=0"], ["-v=0"]]
  procs = [
    subprocess.Popen(
      [sys.executable, str(program), *argv],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),  # logging only: no GPU needed
    )
    for argv in argvs
  ]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  quiet, *verbose = outs
  assert "levels [30, 30, 30]" in quiet, quiet  # logging.WARNING
  assert "orbax warning line" in quiet and "jax warning line" in quiet
  assert "info line" not in quiet, quiet
  for out in verbose:
    assert "levels [20, 20, 20]" in out, out  # logging.INFO
    for line in ("orbax info line", "jax info line", "absl info line", "orbax warning line"):
      assert line in out, out
