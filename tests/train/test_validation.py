"""Flag checks before anything runs: every reproduction of a bad flag gets a flag-style error;
the memory floor against hand-computed bytes; schedule changes refused on resume."""

import dataclasses
import json

import pytest

from jetrl.models import get_config
from jetrl.train import SFTConfig, TrainConfig
from jetrl.train.config import schedule_key
from jetrl.train.loop import resume_check
from jetrl.train.resume import record_changes
from jetrl.train.memory import check_step_memory, step_bytes
from jetrl.train.validation import FlagError

NAN, INF = float("nan"), float("inf")


@pytest.fixture()
def base(tmp_path):
  return TrainConfig(workdir=str(tmp_path / "run"), task="addition", difficulty=1, length=2)


@pytest.mark.parametrize("change, message", [
    ({"seed": 2 ** 64}, r"--seed: must be in \[0, 4294967295\], got 18446744073709551616"),
    ({"seed": -1}, r"--seed: must be in \[0, 4294967295\]"),
    ({"difficulty": 100}, r"--difficulty: must be in \[1, 9\], got 100"),
    ({"length": 0}, r"--length: must be in \[1, 300\], got 0"),
    ({"task": "sorting", "length": 1}, r"--length: must be in \[2, 60\], got 1"),
    ({"lr": INF}, r"--lr: must be a finite number in \(0, 1\], got inf"),
    ({"lr": 2.0}, r"--lr: must be in \(0, 1\], got 2.0"),
    ({"max_grad_norm": NAN}, r"--max_grad_norm: must be a finite number"),
    ({"weight_decay": NAN}, r"--weight_decay: must be a finite number"),
    ({"kl_coef": NAN}, r"--kl_coef: must be a finite number in \[0, 100\], got nan"),
    ({"entropy_coef": -1.0}, r"--entropy_coef: must be in \[0, 100\]"),
    ({"temperature": 1e-30}, r"--temperature: must be in \[0.01, 100\], got 1e-30"),
    ({"temperature": NAN}, r"--temperature: must be a finite number"),
    ({"is_cap": NAN}, r"--is_cap: must be a finite number"),
    ({"clip_low": NAN}, r"--clip_low: must be a finite number"),
    ({"clip_high": INF}, r"--clip_high: must be a finite number in \[0, 10\] or -1.0"),
    ({"steps": 2 ** 40}, r"--steps: must be in \[1, 2147483647\]"),
    ({"max_skipped_steps": 0}, r"--max_skipped_steps: must be in \[1, "),
])
def test_bad_values_are_refused_naming_the_flag(base, change, message):
  with pytest.raises(FlagError, match=message):
    base.replace(**change).validate()


def test_workdir_and_init_from_are_checked(base, tmp_path):
  (tmp_path / "afile").write_text("x")
  with pytest.raises(FlagError, match="--workdir: .*afile' is a file; give a directory"):
    base.replace(workdir=str(tmp_path / "afile")).validate()
  with pytest.raises(FlagError, match="--workdir: .* is inside a file"):
    base.replace(workdir=str(tmp_path / "afile" / "sub")).validate()
  (tmp_path / "notarun").mkdir()
  with pytest.raises(FlagError, match="--init_from: no checkpoint under .*notarun/checkpoints"):
    base.replace(init_from=str(tmp_path / "notarun")).validate()
  assert not (tmp_path / "notarun" / "checkpoints").exists()  # nothing created inside it
  base.validate()


def test_sft_flags_are_checked(tmp_path):
  sft = SFTConfig(workdir=str(tmp_path), task="addition", difficulty=1, length=2)
  for change, message in (({"lr": NAN}, "--lr: must be a finite number"),
                          ({"seed": 2 ** 33}, "--seed: must be in"),
                          ({"difficulty": 10}, r"--difficulty: must be in \[1, 9\]"),
                          ({"ckpt_every": 0}, "--ckpt_every: must be in")):
    with pytest.raises(FlagError, match=message):
      dataclasses.replace(sft, **change).validate()
  sft.validate()


def test_memory_floor_matches_hand_computed_bytes():
  cfg = get_config("tiny")
  n, d, layers, vocab = cfg.n_params, cfg.d_model, cfg.n_layers, cfg.vocab_size
  parts = step_bytes(cfg, rows=16, seq_len=80, micro_rows=4, master_bytes=4, compute_bytes=2,
                     ref_params=True, chunk=256)
  assert parts["params, AdamW state, gradients"] == n * (4 + 4 + 4 + 4 + 4)
  assert parts["rollout KV cache"] == 2 * layers * 16 * 80 * cfg.n_kv_heads * cfg.head_dim * 2
  assert parts["rollout logits"] == 16 * vocab * 4
  per_token = 2 * d + 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + \
      3 * cfg.d_ff
  assert parts["update activations"] == 4 * 80 * layers * per_token * 2
  assert parts["update log-prob chunk"] == 4 * 80 * vocab * 4
  total = sum(parts.values())
  assert check_step_memory(parts, "--x", available=(total, "test")) == total
  with pytest.raises(FlagError, match=r"--x: one step needs at least .* GiB .*more than the "
                                      r"0\.0 GiB of test"):
    check_step_memory(parts, "--x", available=(total - 1, "test"))


def test_a_huge_batch_is_refused_before_anything_is_built(base):
  cfg = get_config("tiny")
  rows = 100_000_000 * 8
  parts = step_bytes(cfg, rows=rows, seq_len=64, micro_rows=rows)
  with pytest.raises(FlagError, match="--prompts_per_step / --group_size: one step needs"):
    check_step_memory(parts, "--prompts_per_step / --group_size")
  assert parts["rollout KV cache"] > 2 ** 40  # terabytes: no machine this test runs on


def test_schedule_change_on_resume(base, tmp_path):
  cosine = base.replace(schedule="cosine", steps=30)
  saved = {"config": cosine.to_dict()}
  changes = []
  resume_check(cosine, "ckpts", changes)(saved)  # same flags
  resume_check(cosine.replace(eval_every=5), "ckpts", changes)(saved)  # not schedule-shaping
  with pytest.raises(FlagError, match=r"--steps: the checkpoint in ckpts was written with "
                                      r"--steps=30, and the learning-rate schedule "
                                      r"\(--schedule=cosine, --warmup_steps=0\) depends on it"):
    resume_check(cosine.replace(steps=40), "ckpts", changes)(saved)
  assert changes == []
  forced = cosine.replace(steps=40, allow_schedule_change=True)
  resume_check(forced, "ckpts", changes)(saved)
  assert changes == [{"field": "steps", "checkpoint": 30, "now": 40,
                      "schedule": "--schedule=cosine, --warmup_steps=0"}]
  logs = []
  record_changes(str(tmp_path), 12, changes, logs.append)
  text = (tmp_path / "config_changes.jsonl").read_text()
  assert '"step": 12' in text and '"checkpoint": 30' in text and "recorded" in logs[0]
  # A constant schedule without warmup does not depend on --steps; with warmup past the
  # new end it does.
  constant = base.replace(steps=30)
  resume_check(constant.replace(steps=40), "ckpts", [])({"config": constant.to_dict()})
  assert schedule_key(constant.replace(steps=40)) == schedule_key(constant)
  warm = base.replace(steps=30, warmup_steps=35)
  assert schedule_key(warm.replace(steps=40)) != schedule_key(warm)
  # Older checkpoints without the newer fields still resume (defaults stand in).
  old = {k: v for k, v in constant.to_dict().items() if k not in ("overwrite",
                                                                  "max_skipped_steps")}
  resume_check(constant, "ckpts", [])({"config": old})


def test_a_bad_data_row_is_a_flag_error_before_anything_is_built(tmp_path):
  from jetrl.data import char_tokenizer
  from jetrl.train import setup
  rows = [{"question": f"what is {i}", "answer": f"so\n#### {i}"} for i in range(300)]
  del rows[186]["answer"]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(FlagError, match=r"--data_path: gsm8k: .*train\.jsonl:187: the row lacks "
                                      r"columns \['answer'\]"):
    setup.load_task("gsm8k", difficulty=0, length=0, data_path=str(path), seed=0,
                    tok=char_tokenizer())
