"""Seconds per RL update step (`jetrl.rl.update_step`) under each recipe, on one batch.

  python experiments/bench_update.py                 # jet, jet_exact: 128 rows x (32 + 64) tokens
  python experiments/bench_update.py --recipes=bf16,jet,jet_exact --rows=64 --repeats=3

One update step is what the RL loop runs after each rollout: the pre-update training forward
(the rollout/training agreement metrics and the importance weights), the forward and backward
of the GRPO loss, and the optimizer step, in one jit. The batch is random tokens on the `tiny`
preset's random weights (the cost does not depend on the values). Each recipe's first call
compiles and is not timed; the median of --repeats calls is printed with its ratio to the
first recipe's.

The model, the update and the optimizer are fields of the configuration named by their paths,
as in experiments/train.py (--model.name, --update.micro_batches, --update.loss,
--optimizer.lr, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Optional

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared fields

from _fields import PRESET_ONLY, json_out_field, preset_model, recipes_field  # noqa: E402
from jetrl.config import check_fields, field, node  # noqa: E402
from jetrl.models import get_config, init_params  # noqa: E402
from jetrl.precision import get_recipe  # noqa: E402
from jetrl.rl import (  # noqa: E402
  OptimizerConfig,
  UpdateConfig,
  init_train_state,
  make_train_batch,
  update_step,
)
from jetrl.train import ModelSpec  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

RENAMED = {"model": "model.name", "micro_batches": "update.micro_batches"}


@dataclasses.dataclass(frozen=True)
class BenchUpdateConfig(Tree):
  """experiments/bench_update.py's settings."""

  model: ModelSpec = preset_model()
  rows: int = field(128, "Rows (completions) per update.", lo=1)
  prompt_len: int = field(32, "Prompt tokens per row.", lo=1)
  new_tokens: int = field(64, "Completion tokens per row.", lo=1)
  update: UpdateConfig = node(UpdateConfig(loss="grpo"), "The policy-gradient update.")
  optimizer: OptimizerConfig = node(OptimizerConfig(lr=1e-5), "AdamW and its schedule.")
  repeats: int = field(5, "Timed calls per recipe (the median is reported).", lo=1)
  recipes: tuple[str, ...] = recipes_field(
    ("jet", "jet_exact"), "Recipes; the first is the baseline."
  )
  json_out: Optional[str] = json_out_field()

  def __post_init__(self):
    check_fields(self)


def run(c: BenchUpdateConfig) -> None:
  cfg = get_config(c.model.name)
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, c.prompt_len + c.new_tokens))
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  r, p, t = c.rows, c.prompt_len, c.new_tokens
  batch = make_train_batch(
    rng.integers(3, cfg.vocab_size, (r, p)).astype(np.int32),
    np.ones((r, p), bool),
    rng.integers(3, cfg.vocab_size, (r, t)).astype(np.int32),
    np.ones((r, t), bool),
    np.full((r, t), -4.0, np.float32),
    rng.standard_normal(r).astype(np.float32),
  )
  ucfg, opt = c.update, c.optimizer
  rows = []
  for name in c.recipes:
    prec = get_recipe(name).train
    state = init_train_state(params, ucfg, opt)
    times = []
    for i in range(c.repeats + 1):
      t0 = time.perf_counter()
      state, _ = update_step(
        state,
        batch,
        jax.random.PRNGKey(i),
        model_config=cfg,
        cfg=ucfg,
        optimizer=opt,
        precision=prec,
      )
      jax.block_until_ready(state.params)
      if i:  # the first call compiles
        times.append(time.perf_counter() - t0)
    rows.append(dict(recipe=name, seconds=float(np.median(times))))
    print(f"  {name}: {rows[-1]['seconds']:.2f} s per update step", flush=True)
  base = rows[0]["seconds"]
  print(
    f"\nmodel {c.model.name} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab "
    f"{cfg.vocab_size}), {r} rows x ({p} + {t}) tokens, micro_batches "
    f"{ucfg.micro_batches}; jax {jax.__version__}\n"
  )
  print(f"| recipe | s / update step | vs {rows[0]['recipe']} |")
  print("|---|---:|---:|")
  for row in rows:
    row["ratio"] = row["seconds"] / base
    print(f"| {row['recipe']} | {row['seconds']:.2f} | {row['ratio']:.2f}x |")
  if c.json_out:
    with open(c.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(BenchUpdateConfig(), run, doc=__doc__, exclude=PRESET_ONLY, renamed=RENAMED)
