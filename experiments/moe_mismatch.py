"""Rollout/training mismatch of a tiny random Qwen3-MoE by recipe and generation length:
routing agreement and per-token |delta log p| (docs/precision_study.md, "Mixture of experts").

For each recipe and length: sample `--prompts` random prompts x `--samples` with the recipe's
rollout precision, recompute the completions' log-probs and each layer's expert choices with
its training forward (`policy_logprobs(..., routing=True)`), and write one JSON line to
`--workdir`/moe_mismatch.jsonl: the share of generated tokens whose top-k experts are the
rollout's in every layer (route_agree), per (token, layer) (route_agree_layer), the mean rank
shift, and mean / max |delta log p|. Then prints the table.

  python experiments/moe_mismatch.py --workdir=/tmp/moe_mismatch
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import app, flags

from jetrl import models as M
from jetrl.precision import get_recipe
from jetrl.rl import make_train_batch, policy_logprobs
from jetrl.rl.routing import route_metrics, route_sums
from jetrl.sampling import SamplingConfig, sample

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/moe_mismatch", "Where the JSON lines go.")
_RECIPES = flags.DEFINE_list(
  "recipes", ["bf16", "fp8_rollout", "jet", "jet_exact"], "Recipes to compare."
)
_LENGTHS = flags.DEFINE_list("lengths", ["32", "128"], "Generation lengths (new tokens).")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Random prompts.")
_SAMPLES = flags.DEFINE_integer("samples", 2, "Samples per prompt.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the model and the prompts.")

# Every expert matrix whole 128x128 blocks; 8 experts, 2 a token.
CONFIG = M.ModelConfig(
  family="qwen3_moe", vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
  head_dim=64, d_ff=256, qk_norm=True, n_experts=8, experts_per_token=2, moe_d_ff=128,
  norm_topk_prob=True, max_seq_len=512,
)  # fmt: skip


def measure(params, recipe: str, length: int, prompts) -> dict:
  r = get_recipe(recipe)
  sc = SamplingConfig(max_new_tokens=length, temperature=1.0, n=_SAMPLES.value, pad_id=0)
  out = jax.tree_util.tree_map(
    np.asarray, sample(params, CONFIG, prompts, jax.random.PRNGKey(_SEED.value), sc, r.rollout)
  )
  batch = make_train_batch(
    out.prompt_tokens,
    out.prompt_mask,
    out.tokens,
    out.mask,
    out.logprobs,
    np.zeros(len(out.tokens)),
    out.routes,
  )
  lp, _, routing = jax.jit(
    policy_logprobs, static_argnames=("model_config", "precision", "chunk_size", "routing")
  )(params, model_config=CONFIG, batch=batch, precision=r.train, chunk_size=128, routing=True)
  d = np.abs(np.asarray(lp) - out.logprobs)[out.mask]
  routes = {
    k: float(v) for k, v in route_metrics(route_sums(out.routes, routing, out.mask)).items()
  }
  return dict(
    recipe=recipe,
    length=length,
    tokens=int(out.mask.sum()),
    abs_dlogp_mean=float(d.mean()),
    abs_dlogp_max=float(d.max()),
    **routes,
  )


def main(argv):
  del argv
  key = jax.random.PRNGKey(_SEED.value)
  params = M.init_params(CONFIG, key)
  # Sharpened so that samples are not uniform noise and routing has clear winners.
  params = jax.tree_util.tree_map(lambda a: a * 3.0 if a.ndim >= 2 else a, params)
  rng = np.random.default_rng(_SEED.value)
  prompts = [rng.integers(1, CONFIG.vocab_size, rng.integers(4, 17)).tolist() for _ in range(8)]
  prompts = prompts[: _PROMPTS.value]
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  with open(os.path.join(_WORKDIR.value, "moe_mismatch.jsonl"), "w") as f:
    for length in (int(n) for n in _LENGTHS.value):
      for recipe in _RECIPES.value:
        row = measure(params, recipe, length, prompts)
        f.write(json.dumps(row) + "\n")
        f.flush()
        rows.append(row)
  print(
    "| recipe | new tokens | tokens | route_agree | route_agree_layer | rank shift | mean abs dlogp | max abs dlogp |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| `{r['recipe']}` | {r['length']} | {r['tokens']} | {r['route_agree']:.4f} | "
      f"{r['route_agree_layer']:.4f} | {r['route_rank_shift']:.4f} | "
      f"{r['abs_dlogp_mean']:.2e} | {r['abs_dlogp_max']:.2e} |"
    )


if __name__ == "__main__":
  app.run(main)
