"""What a warm start trains on: misreported answers (`--answer_noise`) and a mixture of task
lengths (`--mix_lengths`), both fixed by the config so that a resumed run sees the same data."""

import math

import pytest

from jetrl.config import ConfigError, FlagError
from jetrl.data import get_task
from jetrl.data.synthetic import misreport
from jetrl.train import pieces
from jetrl.train.sft import misreported, mixed_tasks


def test_answer_noise_fraction_is_binomial_and_independent_of_batching(tiny_sft_config):
  cfg = tiny_sft_config("w", answer_noise=0.3, task={"name": "addition", "length": 2})
  task = get_task("addition", difficulty=cfg.task.difficulty, length=2)
  problems = task.batch("train", 0, 2000)
  out = misreported(problems, task, cfg, 0)
  flipped = [a.solution != b.solution for a, b in zip(problems, out)]
  # Binomial(2000, 0.3): std 20.5, so 5 std either side of 600.
  assert abs(sum(flipped) - 600) < 5 * math.sqrt(2000 * 0.3 * 0.7)
  assert all(a.answer == b.answer for a, b in zip(problems, out))
  # Drawn per training index: two half batches give the same targets as one batch.
  halves = misreported(problems[:7], task, cfg, 0) + misreported(problems[7:20], task, cfg, 7)
  assert halves == out[:20]
  other_seed = misreported(problems, task, cfg.replace(seed=1), 0)
  assert [a.solution != b.solution for a, b in zip(problems, other_seed)] != flipped
  every = misreported(problems[:50], task, cfg.replace(answer_noise=1.0), 0)
  assert every == [misreport(p, task.answer_chars) for p in problems[:50]]


def test_warm_start_options_are_checked(tiny_sft_config):
  with pytest.raises(ConfigError, match="answer_noise: .* needs a synthetic task"):
    tiny_sft_config("w", answer_noise=0.5, task={"name": "gsm8k"})
  with pytest.raises(ConfigError, match="answer_noise: must be"):
    tiny_sft_config("w", answer_noise=1.5)
  with pytest.raises(ConfigError, match="mix_lengths: 0: must be in"):
    tiny_sft_config("w", mix_lengths=(1, 0))
  with pytest.raises(ConfigError, match="mix_lengths: needs a synthetic task"):
    tiny_sft_config("w", mix_lengths=(1, 2), task={"name": "gsm8k"})


def test_mixed_lengths_take_turns_and_share_one_width(tiny_sft_config):
  cfg = tiny_sft_config("w", mix_lengths=(1, 3), sampling={"max_new_tokens": 64})
  tok = pieces.make_tokenizer(cfg.model, cfg.task)
  task, width = pieces.load_task(cfg.task, seed=cfg.seed, tok=tok)
  tasks, mixed_width = mixed_tasks(cfg, task, width, tok, None)
  assert [t.length for t in tasks] == [1, 3]
  # The width fits the longest prompt of either length: 3-digit operands, "abc+def\n".
  longest = max(len(p.prompt) for t in tasks for p in t.batch("train", 0, 64))
  assert mixed_width >= longest and mixed_width >= width
  assert mixed_tasks(cfg.replace(mix_lengths=()), task, width, tok, None) == ([task], width)
  # Length 3's gold solutions (three scratchpad lines and the answer) do not fit 24 tokens.
  with pytest.raises(FlagError, match="max_new_tokens: at --mix_lengths 3: a gold solution has"):
    mixed_tasks(cfg.replace(sampling={"max_new_tokens": 24}), task, width, tok, None)
