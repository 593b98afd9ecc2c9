"""Rollout-vs-training mismatch against the engine's own noise floor, per recipe.

  python experiments/mismatch_floor.py --init_from=runs/sft --task.name=addition --task.length=3

For each recipe it samples a batch with `recipe.rollout`, then computes the training forward's
log-probs of the same tokens twice: over the whole batch, and in chunks of --chunk_rows rows.
  rollout vs train : mean / max |Δ log p| between the sampler and the training forward
  train vs train   : the same forward at two batch sizes. The math is identical, so this
                     is the engine's batch-variance floor (matmul and attention kernels that
                     sum in a different order for a different number of rows).
A recipe whose rollout-vs-train gap sits at its floor has no systematic mismatch left.

Every flag is a field of the configuration, named by its path: the model, the task and the
sampling settings are experiments/train.py's (--model.name, --task.name, --task.length,
--sampling.n, --sampling.max_new_tokens, --sampling.temperature).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers

from _fields import recipes_field  # noqa: E402
from _mismatch_common import rollout_batch, train_logprobs  # noqa: E402
from jetrl.config import SEED_MAX, ConfigError, check_fields, field, node  # noqa: E402
from jetrl.precision import get_recipe  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.train import ModelSpec, TaskConfig, pieces  # noqa: E402
from jetrl.train.checkpoint import CheckpointError, load_params_from  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

# The flags of this script before it took the configuration's.
RENAMED = {
  "model": "model.name",
  "task": "task.name",
  "difficulty": "task.difficulty",
  "length": "task.length",
  "group_size": "sampling.n",
  "max_new_tokens": "sampling.max_new_tokens",
  "temperature": "sampling.temperature",
}
# Set by the script: the stop and pad ids are the tokenizer's, the prompt width the prompts'.
EXCLUDE = ("sampling.stop_ids", "sampling.prompt_len")


@dataclasses.dataclass(frozen=True)
class FloorConfig(Tree):
  """experiments/mismatch_floor.py's settings."""

  init_from: Optional[str] = field(
    None, "Checkpoint directory (an SFT or RL workdir); none: random init."
  )
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(
    TaskConfig(name="addition", difficulty=1, length=3), "The task whose prompts are sampled."
  )
  sampling: SamplingConfig = node(
    SamplingConfig(max_new_tokens=64, temperature=0.7, n=8), "The rollouts (n per prompt)."
  )
  prompts: int = field(16, "Prompts.", lo=1)
  chunk_rows: int = field(16, "Rows per chunk of the second training forward.", lo=1)
  recipes: tuple[str, ...] = recipes_field(("bf16", "jet", "fp8_rollout", "fp8_tensor"))
  seed: int = field(0, "Seed (task, init, sampling).", lo=0, hi=SEED_MAX)

  def __post_init__(self):
    check_fields(self)
    rows = self.prompts * self.sampling.n
    if rows % self.chunk_rows:
      raise ConfigError("chunk_rows", f"must divide prompts x sampling.n = {rows}")


def run(cfg: FloorConfig) -> None:
  rows = cfg.prompts * cfg.sampling.n
  task = pieces.make_task(cfg.task, seed=cfg.seed)
  tok = pieces.make_tokenizer(cfg.model, cfg.task)
  problems = task.batch("train", 0, cfg.prompts)
  prompts = [pieces.encode_prompt(tok, p.prompt) for p in problems]
  width = pieces.prompt_width(prompts)
  mcfg, params = pieces.make_model(cfg.model, tok, cfg.seed, width + cfg.sampling.max_new_tokens)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params)
  ids = pieces.token_ids(tok)
  sc = dataclasses.replace(cfg.sampling, stop_ids=ids.stop, pad_id=ids.pad, prompt_len=width)
  print("| recipe | rollout vs train: mean abs Δlogp | max | train vs train (floor): mean | max |")
  print("|---|---:|---:|---:|---:|")
  for name in cfg.recipes:
    r = get_recipe(name)
    out = sample(params, mcfg, prompts, jax.random.PRNGKey(cfg.seed), sc, r.rollout)
    batch = rollout_batch(out)
    logp = train_logprobs(mcfg, r.train, sc)
    whole = np.asarray(logp(params, batch))
    step = cfg.chunk_rows
    chunk = lambda i: jax.tree_util.tree_map(lambda a: a[i : i + step], batch)
    chunks = np.concatenate([np.asarray(logp(params, chunk(i))) for i in range(0, rows, step)])
    m = np.asarray(out.mask)
    d_rt = np.abs(np.asarray(out.logprobs) - whole)[m]
    d_tt = np.abs(chunks - whole)[m]
    print(
      f"| {name} | {d_rt.mean():.2e} | {d_rt.max():.2e} | {d_tt.mean():.2e} | {d_tt.max():.2e} |",
      flush=True,
    )


if __name__ == "__main__":
  main(FloorConfig(), run, doc=__doc__, exclude=EXCLUDE, renamed=RENAMED, errors=(CheckpointError,))
