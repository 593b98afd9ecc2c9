"""Seconds per RL update step (`jetrl.rl.update_step`) under each recipe, on one batch.

  python experiments/bench_update.py                 # jet, jet_exact: 128 rows x (32 + 64) tokens
  python experiments/bench_update.py --recipes=bf16,jet,jet_exact --rows=64 --repeats=3

One update step is what the RL loop runs after each rollout: the pre-update training forward
(the rollout/training agreement metrics and the importance weights), the forward and backward
of the GRPO loss, and the optimizer step, in one jit. The batch is random tokens on the `tiny`
preset's random weights (the cost does not depend on the values). Each recipe's first call
compiles and is not timed; the median of --repeats calls is printed with its ratio to the
first recipe's.
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import app, flags

import jax
import numpy as np

from jetrl.models import get_config, init_params
from jetrl.precision import RECIPES, get_recipe
from jetrl.rl import OptimizerConfig, UpdateConfig, init_train_state, make_train_batch, update_step

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "Model preset (random weights).")
flags.DEFINE_integer("rows", 128, "Rows (completions) per update.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 64, "Completion tokens per row.")
flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation micro-batches.")
flags.DEFINE_integer("repeats", 5, "Timed calls per recipe (the median is reported).")
flags.DEFINE_list("recipes", ["jet", "jet_exact"], "Recipes; the first is the baseline.")
flags.DEFINE_string("json_out", None, "Optional path for the results as JSON.")


def main(argv):
  del argv
  bad = [r for r in FLAGS.recipes if r not in RECIPES]
  if bad:
    raise app.UsageError(f"--recipes: unknown {bad}; accepted: {list(RECIPES)}")
  for name in ("rows", "prompt_len", "new_tokens", "micro_batches", "repeats"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1")
  cfg = get_config(FLAGS.model)
  cfg = dataclasses.replace(
    cfg, max_seq_len=max(cfg.max_seq_len, FLAGS.prompt_len + FLAGS.new_tokens)
  )
  params = init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  r, p, t = FLAGS.rows, FLAGS.prompt_len, FLAGS.new_tokens
  batch = make_train_batch(
    rng.integers(3, cfg.vocab_size, (r, p)).astype(np.int32),
    np.ones((r, p), bool),
    rng.integers(3, cfg.vocab_size, (r, t)).astype(np.int32),
    np.ones((r, t), bool),
    np.full((r, t), -4.0, np.float32),
    rng.standard_normal(r).astype(np.float32),
  )
  ucfg = UpdateConfig(loss="grpo", micro_batches=FLAGS.micro_batches)
  opt = OptimizerConfig(lr=1e-5)
  rows = []
  for name in FLAGS.recipes:
    prec = get_recipe(name).train
    state = init_train_state(params, ucfg, opt)
    times = []
    for i in range(FLAGS.repeats + 1):
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
    f"\nmodel {FLAGS.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, vocab "
    f"{cfg.vocab_size}), {r} rows x ({p} + {t}) tokens, micro_batches "
    f"{FLAGS.micro_batches}; jax {jax.__version__}\n"
  )
  print(f"| recipe | s / update step | vs {rows[0]['recipe']} |")
  print("|---|---:|---:|")
  for row in rows:
    row["ratio"] = row["seconds"] / base
    print(f"| {row['recipe']} | {row['seconds']:.2f} | {row['ratio']:.2f}x |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
