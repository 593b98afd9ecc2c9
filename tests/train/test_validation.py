"""Config checks before anything runs: every reproduction of a bad value gets an error naming
the field; paths checked at start-up; the memory floor against hand-computed bytes; schedule
changes refused on resume."""

import json

import pytest

from jetrl.config import ConfigError, FlagError
from jetrl.models import get_config
from jetrl.precision import get_recipe
from jetrl.train import SFTConfig, TrainConfig, resume
from jetrl.train.memory import check_eval_memory, check_step_memory, eval_bytes, step_bytes
from jetrl.train.resume import record_changes

NAN, INF = float("nan"), float("inf")


@pytest.fixture()
def base(tmp_path):
  return TrainConfig(workdir=str(tmp_path / "run")).replace(task={"difficulty": 1, "length": 2})


@pytest.mark.parametrize(
  "change, message",
  [
    ({"seed": 2**64}, r"^seed: must be in \[0, 4294967295\], got 18446744073709551616"),
    ({"seed": -1}, r"^seed: must be in \[0, 4294967295\]"),
    ({"task.difficulty": 100}, r"^task.difficulty: must be in \[1, 9\], got 100"),
    ({"task.length": 0}, r"^task.length: must be in \[1, 300\], got 0"),
    ({"task.name": "sorting", "task.length": 1}, r"^task.length: must be in \[2, 60\], got 1"),
    ({"optimizer.lr": INF}, r"^optimizer.lr: must be a finite number in \(0, 1\], got inf"),
    ({"optimizer.lr": 2.0}, r"^optimizer.lr: must be in \(0, 1\], got 2.0"),
    ({"optimizer.max_grad_norm": NAN}, r"^optimizer.max_grad_norm: must be a finite number"),
    ({"optimizer.weight_decay": NAN}, r"^optimizer.weight_decay: must be a finite number"),
    ({"update.kl_coef": NAN}, r"^update.kl_coef: must be a finite number in \[0, 100\], got nan"),
    ({"update.entropy_coef": -1.0}, r"^update.entropy_coef: must be in \[0, 100\]"),
    (
      {"sampling.temperature": 1e-30},
      r"^sampling.temperature: must be 0 or in \[0.01, 100\], got "
      r"1e-30",
    ),
    ({"sampling.temperature": 0.0}, r"^sampling.temperature: must be > 0 for RL sampling"),
    ({"sampling.temperature": NAN}, r"^sampling.temperature: must be 0 or a finite number"),
    (
      {"eval.temperature": 1e-30},
      r"^eval.temperature: must be 0 or in \[0.01, 100\], got 1e-30",
    ),
    ({"eval.temperature": 0.009}, r"^eval.temperature: must be 0 or in \[0.01, 100\]"),
    ({"eval.temperature": 101.0}, r"^eval.temperature: must be 0 or in \[0.01, 100\]"),
    ({"eval.temperature": NAN}, r"^eval.temperature: must be 0 or a finite number"),
    ({"sampling.n": 1}, r"^sampling.n: must be >= 2 for group-relative advantages"),
    ({"update.is_cap": NAN}, r"^update.is_cap: must be a finite number"),
    ({"update.clip_low": NAN}, r"^update.clip_low: must be a finite number"),
    ({"update.clip_low": 1.0}, r"^update.clip_low: must be < 1"),
    (
      {"update.clip_high": INF},
      r"^update.clip_high: must be a finite number in \[0, 10\], "
      r"got inf",
    ),
    (
      {"update.minibatches": 3},
      r"^update.minibatches: prompts_per_step x sampling.n = 128 rows "
      r"do not split into update.minibatches=3",
    ),
    (
      {"update.overlong_buffer": 64},
      r"^update.overlong_buffer: must be < "
      r"sampling.max_new_tokens \(64\)",
    ),
    ({"update.loss": "ppo"}, r"^update.loss: 'ppo' is not accepted; choose one of \['grpo', "),
    ({"recipe": "fp8"}, r"^recipe: 'fp8' is not accepted; choose one of \['fp32', 'bf16', "),
    ({"mesh": "data:0"}, r"^mesh: "),
    ({"steps": 2**40}, r"^steps: must be in \[1, 2147483647\]"),
    ({"max_skipped_steps": 0}, r"^max_skipped_steps: must be in \[1, "),
  ],
)
def test_bad_values_are_refused_naming_the_field(base, change, message):
  with pytest.raises(ConfigError, match=message):
    base.replace(**change)


def rl_resume_check(cfg, directory, changes):
  return resume.resume_check(cfg, directory, changes, kind="rl")


def test_paths_are_checked_when_a_run_starts(base, tmp_path):
  (tmp_path / "afile").write_text("x")
  with pytest.raises(FlagError, match="--workdir: .*afile' is a file; give a directory"):
    base.replace(workdir=str(tmp_path / "afile")).check_paths()
  with pytest.raises(FlagError, match="--workdir: .* is inside a file"):
    base.replace(workdir=str(tmp_path / "afile" / "sub")).check_paths()
  with pytest.raises(FlagError, match="--workdir: is required"):
    base.replace(workdir=None).check_paths()
  with pytest.raises(FlagError, match="--workdir: 'gs://bucket/run' is a remote path"):
    base.replace(workdir="gs://bucket/run").check_paths()
  (tmp_path / "notarun").mkdir()
  with pytest.raises(FlagError, match="--init_from: no checkpoint under .*notarun/checkpoints"):
    base.replace(init_from=str(tmp_path / "notarun")).check_paths()
  assert not (tmp_path / "notarun" / "checkpoints").exists()  # nothing created inside it
  with pytest.raises(FlagError, match="--model.name: '/no/such/dir' is none of the presets"):
    base.replace(**{"model.name": "/no/such/dir"}).check_paths()
  base.check_paths()


def test_sft_values_are_checked(tmp_path):
  sft = SFTConfig(workdir=str(tmp_path)).replace(task={"difficulty": 1, "length": 2})
  for change, message in (
    ({"optimizer.lr": NAN}, "optimizer.lr: must be a finite number"),
    ({"seed": 2**33}, "seed: must be in"),
    ({"task.difficulty": 10}, r"task.difficulty: must be in \[1, 9\]"),
    ({"checkpoint.every": 0}, "checkpoint.every: must be in"),
  ):
    with pytest.raises(ConfigError, match=message):
      sft.replace(**change)
  sft.check_paths()


def test_memory_floor_matches_hand_computed_bytes():
  cfg = get_config("tiny")
  n, d, layers, vocab = cfg.n_params, cfg.d_model, cfg.n_layers, cfg.vocab_size
  parts = step_bytes(
    cfg,
    rows=16,
    seq_len=80,
    micro_rows=4,
    master_bytes=4,
    recipe=get_recipe("jet"),  # bf16 between operators
    ref_params=True,
    chunk=256,
  )
  assert parts["params, AdamW state, gradients"] == n * (4 + 4 + 4 + 4 + 4)
  assert parts["rollout KV cache"] == 2 * layers * 16 * 80 * cfg.n_kv_heads * cfg.head_dim * 2
  assert parts["rollout logits"] == 16 * vocab * 4
  # A batch-invariant recipe's cache adds each value row's int32 exponent: 4 bytes per slot,
  # layer and kv head.
  exact = step_bytes(cfg, rows=16, seq_len=80, micro_rows=4, recipe=get_recipe("jet_exact"))
  assert (
    exact["rollout KV cache"] == parts["rollout KV cache"] + layers * 16 * 80 * cfg.n_kv_heads * 4
  )
  # An FP8 KV cache: one byte a key or value entry and a float32 scale a head (one 1x128
  # group of the 64-wide heads), no value exponents under jet_exact either.
  for name in ("jet", "jet_exact"):
    fp8 = step_bytes(
      cfg, rows=16, seq_len=80, micro_rows=4, recipe=get_recipe(name, kv_cache="fp8")
    )
    assert fp8["rollout KV cache"] == (
      parts["rollout KV cache"] // 2 + 2 * layers * 16 * 80 * cfg.n_kv_heads * 4
    )
  per_token = (
    2 * d + 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.d_ff
  )
  assert parts["update activations"] == 4 * 80 * layers * per_token * 2
  assert parts["update log-prob chunk"] == 4 * 80 * vocab * 4
  # fp32 between operators: 4-byte cache values and activations.
  fp32 = step_bytes(cfg, rows=16, seq_len=80, micro_rows=4, recipe=get_recipe("fp32"))
  assert fp32["update activations"] == 4 * 80 * layers * per_token * 4
  assert fp32["rollout KV cache"] == 2 * parts["rollout KV cache"]
  total = sum(parts.values())
  assert check_step_memory(parts, "--x", available=(total, "test")) == total
  with pytest.raises(
    FlagError,
    match=r"--x: one step needs at least .* GiB .*more than the "
    r"0\.0 GiB of test",
  ):
    check_step_memory(parts, "--x", available=(total - 1, "test"))


def test_evaluation_temperatures_greedy_or_as_sampling(base):
  for t in (0.0, 0.01, 0.5, 100.0):
    assert base.replace(eval={"temperature": t}).eval.temperature == t
  # The ends of the range hold for sampling too (0.01 rounds below 0.01 in float32).
  for t in (0.01, 100.0):
    assert base.replace(sampling={"temperature": t}).sampling.temperature == t
  for t in (1e-30, 0.0099):
    with pytest.raises(ConfigError, match="^eval.temperature: must be 0 or in"):
      SFTConfig(workdir="w").replace(eval={"temperature": t})


def test_evaluation_memory_matches_hand_computed_bytes():
  cfg = get_config("tiny")
  layers, kv = cfg.n_layers, cfg.n_kv_heads * cfg.head_dim
  # 8 problems x 4 samples a call, prompts 32 wide, 40 new tokens, bf16 cache.
  parts = eval_bytes(cfg, rows=32, max_new_tokens=40, resident=1000, prompt_width=32)
  assert parts == {
    "params and optimizer state": 1000,
    "evaluation KV cache": 2 * layers * 32 * (32 + 40) * kv * 2,
    "evaluation logits": 32 * cfg.vocab_size * 4,
  }
  # Without a known prompt width, the narrowest one a sampler call holds (16 tokens).
  assert eval_bytes(cfg, rows=1, max_new_tokens=40, resident=0)["evaluation KV cache"] == (
    2 * layers * 1 * (16 + 40) * kv * 2
  )
  total = sum(parts.values())
  flags = "--eval.batch / --eval.samples"
  assert check_eval_memory(parts, flags, available=(total, "test")) == total
  with pytest.raises(
    FlagError,
    match=r"^--eval.batch / --eval.samples: one evaluation call needs at least 0\.0 GiB "
    r"\(evaluation KV cache .*\), more than the 0\.0 GiB of test; lower them$",
  ):
    check_eval_memory(parts, flags, available=(total - 1, "test"))


def test_a_huge_batch_is_refused_before_anything_is_built(base):
  cfg = get_config("tiny")
  rows = 100_000_000 * 8
  parts = step_bytes(cfg, rows=rows, seq_len=64, micro_rows=rows)
  with pytest.raises(FlagError, match="--prompts_per_step / --group_size: one step needs"):
    check_step_memory(parts, "--prompts_per_step / --group_size")
  assert parts["rollout KV cache"] > 2**40  # terabytes: no machine this test runs on


def test_schedule_change_on_resume(base, tmp_path):
  cosine = base.replace(optimizer={"schedule": "cosine"}, steps=30)
  saved = {"config": cosine.to_dict(), "kind": "rl"}
  changes = []
  rl_resume_check(cosine, "ckpts", changes)(saved)  # same flags
  rl_resume_check(cosine.replace(eval={"every": 5}), "ckpts", changes)(
    saved
  )  # not schedule-shaping
  schedule = "--optimizer.schedule=cosine, --optimizer.warmup_steps=0"
  with pytest.raises(
    FlagError,
    match=r"--steps: the checkpoint in ckpts was written with "
    r"--steps=30, and the learning-rate schedule "
    rf"\({schedule}\) depends on it",
  ):
    rl_resume_check(cosine.replace(steps=40), "ckpts", changes)(saved)
  assert changes == []
  forced = cosine.replace(steps=40, allow_schedule_change=True)
  rl_resume_check(forced, "ckpts", changes)(saved)
  assert changes == [{"field": "steps", "checkpoint": 30, "now": 40, "schedule": schedule}]
  logs = []
  record_changes(str(tmp_path), 12, changes, logs.append)
  text = (tmp_path / "config_changes.jsonl").read_text()
  assert '"step": 12' in text and '"checkpoint": 30' in text and "recorded" in logs[0]
  # A constant schedule without warmup does not depend on --steps; with warmup past the
  # new end it does.
  constant = base.replace(steps=30)
  rl_resume_check(constant.replace(steps=40), "ckpts", [])({"config": constant.to_dict()})
  warm = base.replace(steps=30, optimizer={"warmup_steps": 35})
  with pytest.raises(FlagError, match="--steps: the checkpoint in ckpts was written with"):
    rl_resume_check(warm.replace(steps=40), "ckpts", [])({"config": warm.to_dict()})
  # Older checkpoints without the newer fields still resume (defaults stand in).
  old = constant.to_dict()
  del old["overwrite"], old["logging"]["plot_every"], old["update"]["remat"]
  rl_resume_check(constant, "ckpts", [])({"config": old})


def test_a_bad_data_row_is_a_flag_error_before_anything_is_built(tmp_path):
  from jetrl.data import char_tokenizer
  from jetrl.train import pieces

  rows = [{"question": f"what is {i}", "answer": f"so\n#### {i}"} for i in range(300)]
  del rows[186]["answer"]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  from jetrl.train import TaskConfig

  with pytest.raises(
    FlagError,
    match=r"--task.data_path: gsm8k: .*train\.jsonl:187: the row "
    r"lacks columns \['answer'\]",
  ):
    pieces.load_task(TaskConfig(name="gsm8k", data_path=str(path)), seed=0, tok=char_tokenizer())
