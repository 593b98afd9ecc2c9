"""Building a run's pieces from its config nodes: tokenizer, task, model, prompts, evaluation.

Every tokenizer is used through `jetrl.data.Tokenizer` (the character tokenizer, a
checkpoint's, or a `transformers` one): `encode(text)` for a prompt as the model expects it to
start, `encode(text, add_special_tokens=False)` + eos for a completion, `stop_token_ids` for
the ids that end a sample.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple, Optional, Sequence

import jax
import numpy as np

from jetrl.config import FlagError
from jetrl.data import char_tokenizer, get_task, stop_token_ids
from jetrl.data.tokenizer import Tokenizer
from jetrl.models import check_vocab, get_config, init_params, load_pretrained, load_tokenizer
from jetrl.models.hf_io import config_from_hf
from jetrl.sampling import SamplingConfig, sample


class TokenIds(NamedTuple):
  bos: Optional[int]
  eos: int
  pad: int
  stop: tuple[int, ...]  # every id that ends a sample (eos among them)


def token_ids(tok: Tokenizer) -> TokenIds:
  """bos / eos / pad / stop ids of a tokenizer (pad: eos when it has none)."""
  eos = tok.eos_token_id
  if eos is None:
    raise ValueError("the tokenizer has no eos token: cannot stop generation")
  pad = tok.pad_token_id if tok.pad_token_id is not None else eos
  return TokenIds(tok.bos_token_id, int(eos), int(pad), stop_token_ids(tok) or (int(eos),))


def make_task(task, *, seed: int):
  """The task of a `TaskConfig` (synthetic: its knobs; dataset: its files or the hub)."""
  if task.synthetic:
    return get_task(task.name, difficulty=task.difficulty, length=task.length, seed=seed)
  kw = dict(seed=seed)
  if task.data_path:
    kw["path"] = task.data_path
  return get_task(task.name, **kw)


def load_task(task, *, seed: int, tok: Tokenizer):
  """(task, prompt width): the task, its data loaded and checked, and the static prompt width
  (the longest of its first 64 train prompts, rounded up to 16, plus 16). A data error is a
  FlagError naming --task.data_path (or --task.name), with the file and line it found."""
  try:
    loaded = make_task(task, seed=seed)
    probe = [encode_prompt(tok, p.prompt) for p in loaded.batch("train", 0, 64)]
  except ValueError as e:
    raise FlagError("task.data_path" if task.data_path else "task.name", str(e)) from None
  return loaded, prompt_width(probe) + 16


def make_tokenizer(model, task) -> Tokenizer:
  """A checkpoint's own tokenizer, or the character tokenizer of the synthetic tasks."""
  if os.path.isdir(model.name):
    try:
      return load_tokenizer(model.name)
    except ValueError as e:
      raise FlagError("model.name", str(e)) from None
  if not task.synthetic:
    raise FlagError(
      "model.name",
      f"task {task.name!r} needs a checkpoint directory with its "
      f"own tokenizer; the preset {model.name!r} only fits the synthetic tasks",
    )
  return char_tokenizer()


def model_config(model, tok: Tokenizer, max_seq_len: int):
  """The model's config without its weights: a preset sized to the tokenizer, or a
  checkpoint's config.json (cheap: memory and tokenizer checks run before any weight)."""
  if os.path.isdir(model.name):
    path = os.path.join(model.name, "config.json")
    try:
      with open(path, encoding="utf-8") as f:
        mcfg = config_from_hf(json.load(f))
    except (OSError, ValueError) as e:  # missing, not JSON, or an unsupported model
      raise FlagError("model.name", f"{path}: {e}") from None
  else:
    mcfg = dataclasses.replace(get_config(model.name), vocab_size=len(tok))
  if model.n_layers is not None:
    if os.path.isdir(model.name) and model.n_layers > mcfg.n_layers:
      raise FlagError(
        "model.n_layers", f"{model.n_layers} is more than the checkpoint's {mcfg.n_layers} layers"
      )
    mcfg = dataclasses.replace(mcfg, n_layers=model.n_layers)
  if max_seq_len > mcfg.max_seq_len:
    mcfg = dataclasses.replace(mcfg, max_seq_len=max_seq_len)
  return mcfg


def make_params(model, mcfg, seed: int):
  """float32 params for `mcfg` (from model_config): a checkpoint's weights (checked finite and
  of a float dtype at load), or a seeded random init."""
  if not os.path.isdir(model.name):
    return init_params(mcfg, jax.random.PRNGKey(seed))
  _, params = load_pretrained(model.name)
  n_layers = mcfg.n_layers
  return dict(params, layers=jax.tree_util.tree_map(lambda a: a[:n_layers], params["layers"]))


def make_model(model, tok: Tokenizer, seed: int, max_seq_len: int):
  """(model_config, float32 params): a preset sized to the tokenizer, or a checkpoint."""
  mcfg = model_config(model, tok, max_seq_len)
  check_tokenizer(mcfg, tok)
  return mcfg, make_params(model, mcfg, seed)


def check_tokenizer(mcfg, tok: Tokenizer) -> None:
  """FlagError (--model.name) when the tokenizer can produce, or the run uses, an id the
  model's embedding does not have (`jetrl.models.check_vocab`)."""
  try:
    check_vocab(mcfg, tok)
  except ValueError as e:
    raise FlagError(
      "model.name", f"{e}; a checkpoint's tokenizer and config.json must agree"
    ) from None


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
  """A prompt's ids as the model expects a sequence to start (bos first where it has one)."""
  return list(tok.encode(text))


def encode_completion(tok: Tokenizer, text: str) -> list[int]:
  """A completion's ids, ended by eos (the training target of a gold solution)."""
  return list(tok.encode(text, add_special_tokens=False)) + [token_ids(tok).eos]


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
  return tok.decode([int(i) for i in ids])


def prompt_width(prompts: Sequence[Sequence[int]]) -> int:
  """Static prompt width: the longest prompt rounded up to a multiple of 16."""
  return -(-max(len(p) for p in prompts) // 16) * 16


def completions_and_rewards(task, tok, problems, rollout, group: int):
  """Decode a rollout's completions and score them; rows are prompt-major."""
  toks, lens = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
  stop = set(token_ids(tok).stop)
  texts = []
  for row, n in zip(toks, lens):
    row = row[:n]
    texts.append(decode(tok, row[:-1] if n and int(row[-1]) in stop else row))
  prompts = [p.prompt for p in problems for _ in range(group)]
  answers = [p.answer for p in problems for _ in range(group)]
  return texts, np.asarray(task.reward(prompts, texts, answers), np.float32)


def evaluate(
  params,
  mcfg,
  task,
  tok,
  precision,
  *,
  size: int,
  max_new_tokens: int,
  batch: int = 64,
  split: str = "test",
  temperature: float = 0.0,
  samples: int = 1,
  seed: int = 0,
) -> dict:
  """Accuracy on the first `size` problems of a held-out split: greedy (temperature 0), or the
  mean over `samples` completions per problem drawn at `temperature` from a fixed key (`seed`),
  so that two policies evaluated alike see the same random numbers."""
  problems = task.batch(split, 0, size)
  ids = token_ids(tok)
  correct, lengths = [], []
  for i in range(0, size, batch):
    chunk = problems[i : i + batch]
    prompts = [encode_prompt(tok, p.prompt) for p in chunk]
    sc = SamplingConfig(
      max_new_tokens=max_new_tokens,
      temperature=float(temperature),
      n=int(samples) if temperature > 0 else 1,
      stop_ids=ids.stop,
      pad_id=ids.pad,
      prompt_len=prompt_width(prompts),
    )
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    out = sample(params, mcfg, prompts, key, sc, precision)
    if jax.process_count() > 1:  # rows may live on other hosts: gather before decoding text
      from jetrl.parallel import to_host

      out = to_host(out)
    _, rewards = completions_and_rewards(task, tok, chunk, out, sc.n)
    correct += list(rewards)
    lengths += list(np.asarray(out.lengths))
  return {
    "eval_accuracy": float(np.mean(np.asarray(correct) >= 1.0)),
    "eval_reward": float(np.mean(correct)),
    "eval_length": float(np.mean(lengths)),
  }
