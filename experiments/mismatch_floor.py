"""Rollout-vs-training mismatch against the engine's own noise floor, per recipe.

  python experiments/mismatch_floor.py --init_from=runs/sft --task=addition --length=3

For each recipe it samples a batch with `recipe.rollout`, then computes the training forward's
log-probs of the same tokens twice: over the whole batch, and in chunks of --chunk_rows rows.
  rollout vs train : mean / max |Δ log p| between the sampler and the training forward
  train vs train   : the same forward at two batch sizes. The math is identical, so this
                     is the engine's batch-variance floor (matmul and attention kernels that
                     sum in a different order for a different number of rows).
A recipe whose rollout-vs-train gap sits at its floor has no systematic mismatch left.
"""

from __future__ import annotations

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.precision import RECIPES, get_recipe
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.sampling import SamplingConfig, sample
from jetrl.train import ModelSpec, TaskConfig, pieces
from jetrl.train.checkpoint import load_params_from

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "init_from", "", "Checkpoint directory (an SFT or RL workdir); empty: random init."
)
flags.DEFINE_string("model", "tiny", "Model preset.")
flags.DEFINE_string("task", "addition", "Synthetic task.")
flags.DEFINE_integer("difficulty", 1, "Task difficulty knob.")
flags.DEFINE_integer("length", 3, "Task length knob.")
flags.DEFINE_integer("prompts", 16, "Prompts.")
flags.DEFINE_integer("group_size", 8, "Samples per prompt.")
flags.DEFINE_integer("max_new_tokens", 64, "Generation budget.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature.")
flags.DEFINE_integer("chunk_rows", 16, "Rows per chunk of the second training forward.")
flags.DEFINE_list("recipes", ["bf16", "jet", "fp8_rollout", "fp8_tensor"], "Recipes.")
flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
  del argv
  bad = [r for r in FLAGS.recipes if r not in RECIPES]
  if bad:
    raise app.UsageError(f"--recipes: unknown {bad}; accepted: {list(RECIPES)}")
  rows = FLAGS.prompts * FLAGS.group_size
  if rows % FLAGS.chunk_rows:
    raise app.UsageError(f"--chunk_rows must divide prompts x group_size = {rows}")
  task_cfg = TaskConfig(name=FLAGS.task, difficulty=FLAGS.difficulty, length=FLAGS.length)
  model = ModelSpec(name=FLAGS.model)
  task = pieces.make_task(task_cfg, seed=FLAGS.seed)
  tok = pieces.make_tokenizer(model, task_cfg)
  problems = task.batch("train", 0, FLAGS.prompts)
  prompts = [pieces.encode_prompt(tok, p.prompt) for p in problems]
  width = pieces.prompt_width(prompts)
  mcfg, params = pieces.make_model(model, tok, FLAGS.seed, width + FLAGS.max_new_tokens)
  if FLAGS.init_from:
    params = load_params_from(FLAGS.init_from, params)
  ids = pieces.token_ids(tok)
  fn = jax.jit(policy_logprobs, static_argnames=("model_config", "precision", "temperature"))
  print("| recipe | rollout vs train: mean abs Δlogp | max | train vs train (floor): mean | max |")
  print("|---|---:|---:|---:|---:|")
  for name in FLAGS.recipes:
    r = get_recipe(name)
    sc = SamplingConfig(
      max_new_tokens=FLAGS.max_new_tokens,
      temperature=FLAGS.temperature,
      n=FLAGS.group_size,
      stop_ids=ids.stop,
      pad_id=ids.pad,
      prompt_len=width,
    )
    out = sample(params, mcfg, prompts, jax.random.PRNGKey(FLAGS.seed), sc, r.rollout)
    batch = make_train_batch(
      out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, jnp.zeros(rows)
    )
    kw = dict(model_config=mcfg, precision=r.train, temperature=FLAGS.temperature)
    whole = np.asarray(fn(params, batch=batch, **kw)[0])
    step = FLAGS.chunk_rows
    chunks = np.concatenate(
      [
        np.asarray(
          fn(params, batch=jax.tree_util.tree_map(lambda a: a[i : i + step], batch), **kw)[0]
        )
        for i in range(0, rows, step)
      ]
    )
    m = np.asarray(out.mask)
    d_rt = np.abs(np.asarray(out.logprobs) - whole)[m]
    d_tt = np.abs(chunks - whole)[m]
    print(
      f"| {name} | {d_rt.mean():.2e} | {d_rt.max():.2e} | {d_tt.mean():.2e} | {d_tt.max():.2e} |",
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)
