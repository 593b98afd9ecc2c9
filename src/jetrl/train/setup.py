"""Building a run's pieces from its config: task, tokenizer, model, prompts, evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from jetrl.data import SYNTHETIC_TASKS, char_tokenizer, get_task
from jetrl.models import get_config, init_params, load_pretrained, load_tokenizer
from jetrl.models.hf_io import config_from_hf
from jetrl.sampling import SamplingConfig, sample
from jetrl.train.validation import FlagError


class TokenIds(NamedTuple):
  bos: Any
  eos: int
  pad: int


def token_ids(tok) -> TokenIds:
  """bos / eos / pad ids of the project's char tokenizer or a checkpoint's tokenizer."""
  if hasattr(tok, "eos_id"):
    return TokenIds(tok.bos_id, tok.eos_id, tok.pad_id)
  eos = tok.eos_token_id
  if eos is None:
    raise ValueError("the checkpoint's tokenizer has no eos token: cannot stop generation")
  pad = tok.pad_token_id if tok.pad_token_id is not None else eos
  return TokenIds(tok.bos_token_id, eos, pad)


def make_task(name: str, *, difficulty: int, length: int, data_path: str, seed: int):
  if name in SYNTHETIC_TASKS:
    return get_task(name, difficulty=difficulty, length=length, seed=seed)
  kw = dict(seed=seed)
  if data_path:
    kw["path"] = data_path
  return get_task(name, **kw)


def load_task(name: str, *, difficulty: int, length: int, data_path: str, seed: int, tok):
  """(task, prompt width): the task, its data loaded and checked, and the static prompt width
  (the longest of its first 64 train prompts, rounded up to 16, plus 16). A data error is a
  FlagError naming --data_path (or --task), with the file and line it found."""
  try:
    task = make_task(name, difficulty=difficulty, length=length, data_path=data_path, seed=seed)
    probe = [encode_prompt(tok, p.prompt) for p in task.batch("train", 0, 64)]
  except ValueError as e:
    raise FlagError("data_path" if data_path else "task", str(e)) from None
  return task, prompt_width(probe) + 16


def make_tokenizer(model: str, task_name: str):
  if os.path.isdir(model):
    try:
      return load_tokenizer(model)
    except ValueError as e:
      raise FlagError("model", str(e)) from None
  if task_name not in SYNTHETIC_TASKS:
    raise FlagError("model", f"task {task_name!r} needs a checkpoint directory with its own "
                    f"tokenizer; the preset {model!r} only fits the synthetic tasks "
                    f"{list(SYNTHETIC_TASKS)}")
  return char_tokenizer()


def model_config(model: str, n_layers: int, tok, max_seq_len: int):
  """The model's config without its weights: a preset sized to the tokenizer, or a
  checkpoint's config.json (cheap: memory and tokenizer checks run before any weight)."""
  if os.path.isdir(model):
    path = os.path.join(model, "config.json")
    try:
      with open(path, encoding="utf-8") as f:
        mcfg = config_from_hf(json.load(f))
    except (OSError, ValueError) as e:  # missing, not JSON, or an unsupported model
      raise FlagError("model", f"{path}: {e}") from None
  else:
    mcfg = dataclasses.replace(get_config(model), vocab_size=_vocab(tok))
  if n_layers:
    if os.path.isdir(model) and n_layers > mcfg.n_layers:
      raise FlagError("n_layers", f"{n_layers} is more than the checkpoint's {mcfg.n_layers} "
                      "layers")
    mcfg = dataclasses.replace(mcfg, n_layers=n_layers)
  if max_seq_len > mcfg.max_seq_len:
    mcfg = dataclasses.replace(mcfg, max_seq_len=max_seq_len)
  return mcfg


def make_params(model: str, mcfg, seed: int):
  """float32 params for `mcfg` (from model_config): a checkpoint's weights (checked finite and
  of a float dtype at load), or a seeded random init."""
  if not os.path.isdir(model):
    return init_params(mcfg, jax.random.PRNGKey(seed))
  _, params = load_pretrained(model)
  n_layers = mcfg.n_layers
  return dict(params, layers=jax.tree_util.tree_map(lambda a: a[:n_layers], params["layers"]))


def make_model(model: str, n_layers: int, tok, seed: int, max_seq_len: int):
  """(model_config, float32 params): a preset sized to the tokenizer, or a checkpoint."""
  mcfg = model_config(model, n_layers, tok, max_seq_len)
  check_tokenizer(mcfg, tok)
  return mcfg, make_params(model, mcfg, seed)


def check_tokenizer(mcfg, tok) -> None:
  """FlagError (--model) when the tokenizer can produce, or the run uses, an id the model's
  embedding does not have: its size, and its bos / eos / pad and extra end-of-generation ids."""
  ids = token_ids(tok)
  named = {"tokenizer size - 1": _vocab(tok) - 1, "eos id": ids.eos, "pad id": ids.pad}
  if ids.bos is not None:
    named["bos id"] = ids.bos
  for k, extra in enumerate(getattr(tok, "eos_token_ids", ()) or ()):
    named[f"end-of-generation id #{k}"] = extra
  bad = {k: int(v) for k, v in named.items() if not 0 <= int(v) < mcfg.vocab_size}
  if bad:
    listing = ", ".join(f"{k} {v}" for k, v in bad.items())
    raise FlagError("model", f"the tokenizer does not fit the model: {listing} not in "
                    f"[0, vocab_size={mcfg.vocab_size}); a checkpoint's tokenizer and "
                    "config.json must agree")


def _vocab(tok) -> int:
  size = tok.vocab_size
  return int(size() if callable(size) else size)


def encode_prompt(tok, text: str) -> list[int]:
  ids = token_ids(tok)
  if hasattr(tok, "eos_id"):
    return ([ids.bos] if ids.bos is not None else []) + tok.encode(text)
  return tok.encode(text)


def encode_completion(tok, text: str) -> list[int]:
  body = tok.encode(text) if hasattr(tok, "eos_id") else tok.encode(text, add_special_tokens=False)
  return body + [token_ids(tok).eos]


def decode(tok, ids: Sequence[int]) -> str:
  return tok.decode([int(i) for i in ids])


def prompt_width(prompts: Sequence[Sequence[int]]) -> int:
  """Static prompt width: the longest prompt rounded up to a multiple of 16."""
  return -(-max(len(p) for p in prompts) // 16) * 16


def completions_and_rewards(task, tok, problems, rollout, group: int):
  """Decode a rollout's completions and score them; rows are prompt-major."""
  toks, lens = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
  eos = token_ids(tok).eos
  texts = []
  for row, n in zip(toks, lens):
    row = row[:n]
    texts.append(decode(tok, row[:-1] if n and row[-1] == eos else row))
  prompts = [p.prompt for p in problems for _ in range(group)]
  answers = [p.answer for p in problems for _ in range(group)]
  return texts, np.asarray(task.reward(prompts, texts, answers), np.float32)


def evaluate(params, mcfg, task, tok, precision, *, size: int, max_new_tokens: int,
             batch: int = 64, split: str = "test") -> dict:
  """Greedy accuracy on the first `size` problems of a held-out split."""
  problems = task.batch(split, 0, size)
  ids = token_ids(tok)
  correct, lengths = [], []
  for i in range(0, size, batch):
    chunk = problems[i:i + batch]
    prompts = [encode_prompt(tok, p.prompt) for p in chunk]
    sc = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, n=1, stop_ids=(ids.eos,),
                        pad_id=ids.pad, prompt_len=prompt_width(prompts))
    out = sample(params, mcfg, prompts, jax.random.PRNGKey(0), sc, precision)
    if jax.process_count() > 1:  # rows may live on other hosts: gather before decoding text
      from jetrl.parallel import to_host
      out = to_host(out)
    _, rewards = completions_and_rewards(task, tok, chunk, out, 1)
    correct += list(rewards)
    lengths += list(np.asarray(out.lengths))
  return {"eval_accuracy": float(np.mean(np.asarray(correct) >= 1.0)),
          "eval_reward": float(np.mean(correct)), "eval_length": float(np.mean(lengths))}
