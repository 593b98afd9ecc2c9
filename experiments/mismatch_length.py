"""Rollout/training mismatch against generated length on a real model: SmolLM2-135M-Instruct on
GSM8K prompts (chat template), per recipe, against the recipe's own train-vs-train floor.

  python experiments/mismatch_length.py --prompts=2 --samples=2 --lengths=128,512,2048 \
      --json_out=runs/mismatch_length.json --plot=runs/mismatch_length.png

For each recipe it samples --samples completions of each of the first --prompts GSM8K test
questions with `recipe.rollout`, --max(lengths) new tokens each (temperature --temperature;
with --stop=false, the default, the end-of-turn ids do not stop a row, so that every row
reaches the budget: past the model's own end of answer the text is its free continuation).
Then the training forward (`recipe.train`) scores the same tokens twice: over the whole batch,
and one (padded) row at a time.

  rollout vs train : Δ = training-forward log p − rollout log p of each sampled token
  floor            : Δ = whole-batch training forward − the training forward of each row alone,
                     its sequence right-padded by --floor_pad masked tokens: the same math over
                     other shapes (rows, sequence length), so the engine's own floor

Both are reported over the first L generated tokens for each L of --lengths (prefixes of the
same samples: a prefix of a longer sample is distributed like a sample of that length): mean
|Δ|, mean over rows of |Σ_t Δ_t| (the sequence log importance ratio), k3 KL, the fraction of
tokens whose ratio exp(Δ) leaves [0.8, 1.2], and mean |Δ| by token position. Prints a markdown
table; --json_out and --plot write the numbers and a figure.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import models as M
from jetrl.data.prompts import chat_prompt_ids, user_message
from jetrl.models import smollm2
from jetrl.precision import RECIPES, get_recipe
from jetrl.rl.agreement import DEFAULT_EDGES, agreement_metrics
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.sampling import SamplingConfig, sample

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "model",
  os.path.join(os.path.expanduser(smollm2.DEFAULT_CACHE), smollm2.FOLDER),
  "A Hugging Face folder (default: the SmolLM2-135M-Instruct folder of `make smollm2`).",
)
flags.DEFINE_string(
  "gsm8k",
  os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "test.jsonl"),
  "GSM8K test split (JSON lines with a `question` field).",
)
flags.DEFINE_integer("prompts", 2, "GSM8K questions (the first ones of the file).")
flags.DEFINE_integer("samples", 2, "Samples per question.")
flags.DEFINE_list("lengths", ["128", "512", "2048"], "Generated-token prefixes to report.")
flags.DEFINE_list("recipes", ["bf16", "fp8_rollout", "jet"], "Recipes.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (the log-probs' temperature too).")
flags.DEFINE_bool("stop", False, "Stop a row at the model's end-of-turn ids.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("floor_pad", 64, "Masked tokens appended to each row for the floor.")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_string("plot", None, "Write a PNG figure here.")


_ROLLOUTS: dict = {}


def measure(params, config, prompts, tok, name: str, lengths: list[int]) -> dict:
  """The rollout-vs-train and floor metrics of one recipe at each prefix length. Recipes with
  the same rollout precision (fp8_rollout and jet) score the same samples."""
  recipe = get_recipe(name)
  t0 = time.time()
  sc = SamplingConfig(
    max_new_tokens=max(lengths),
    temperature=FLAGS.temperature,
    n=FLAGS.samples,
    stop_ids=M.stop_ids(tok) if FLAGS.stop else (),
    pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
  )
  if recipe.rollout not in _ROLLOUTS:
    out = sample(params, config, prompts, jax.random.PRNGKey(FLAGS.seed), sc, recipe.rollout)
    _ROLLOUTS[recipe.rollout] = jax.block_until_ready(out)
  out = _ROLLOUTS[recipe.rollout]
  t_sample = time.time() - t0
  rows = out.tokens.shape[0]
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, jnp.zeros(rows)
  )
  fn = jax.jit(policy_logprobs, static_argnames=("model_config", "precision", "temperature"))
  kw = dict(model_config=config, precision=recipe.train, temperature=FLAGS.temperature)
  t0 = time.time()
  whole = fn(params, batch=batch, **kw)[0]
  # The floor: each row alone, its sequence right-padded by --floor_pad masked tokens (the same
  # math over other shapes: one row instead of all, a longer sequence).
  pad = FLAGS.floor_pad
  alone = []
  for i in range(rows):
    row = lambda a, i=i: np.asarray(a[i : i + 1])
    extra = lambda a, v: np.concatenate([row(a), np.full((1, pad), v, row(a).dtype)], axis=1)
    one = make_train_batch(
      row(out.prompt_tokens),
      row(out.prompt_mask),
      extra(out.tokens, sc.pad_id),
      extra(out.mask, False),
      extra(out.logprobs, 0.0),
      jnp.zeros(1),
    )
    alone.append(fn(params, batch=one, **kw)[0][:, : out.tokens.shape[1]])
  alone = jnp.concatenate(alone)
  jax.block_until_ready(alone)
  t_score = time.time() - t0
  cols = np.arange(out.tokens.shape[1])[None, :]
  edges = tuple(e for e in DEFAULT_EDGES if e < max(lengths))
  agree = jax.jit(agreement_metrics, static_argnames=("bin_edges",))
  res = dict(
    recipe=name,
    rows=rows,
    sample_s=t_sample,
    score_s=t_score,
    mean_length=float(np.asarray(out.lengths).mean()),
    edges=list(edges),
    by_length={},
  )
  for L in lengths:
    mask = np.asarray(out.mask) & (cols < L)
    entry = {}
    for kind, ref in (("rollout_vs_train", out.logprobs), ("floor", alone)):
      m = agree(ref, whole, mask, bin_edges=edges)
      entry[kind] = {
        k: np.asarray(v).tolist()
        for k, v in m.items()
        if k
        in (
          "abs_diff_mean",
          "abs_diff_max",
          "seq_abs_sum_mean",
          "kl_k3",
          "ratio_out_frac",
          "n_tokens",
          "bin_abs_diff_mean",
          "bin_count",
        )
      }
    res["by_length"][str(L)] = entry
  return res


def table(results: list[dict], lengths: list[int]) -> str:
  head = (
    "| recipe | generated tokens | rollout vs train: mean \\|Δ\\| | mean \\|ΣΔ\\| per seq. | "
    "k3 KL | outside [0.8, 1.2] | floor: mean \\|Δ\\| | mean \\|ΣΔ\\| | k3 KL | gap / floor "
    "(mean \\|Δ\\|) |"
  )
  lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    for L in lengths:
      a, f = r["by_length"][str(L)]["rollout_vs_train"], r["by_length"][str(L)]["floor"]
      ratio = a["abs_diff_mean"] / f["abs_diff_mean"] if f["abs_diff_mean"] > 0 else float("inf")
      lines.append(
        f"| {r['recipe']} | {L} | {a['abs_diff_mean']:.2e} | {a['seq_abs_sum_mean']:.2f} | "
        f"{a['kl_k3']:.2e} | {a['ratio_out_frac']:.3f} | {f['abs_diff_mean']:.2e} | "
        f"{f['seq_abs_sum_mean']:.2f} | {f['kl_k3']:.2e} | {ratio:.1f} |"
      )
  return "\n".join(lines)


def plot(results: list[dict], lengths: list[int], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  from jetrl.train.plots import bin_labels  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
  for i, r in enumerate(results):
    c = plt.cm.tab10(i)
    for kind, style in (("rollout_vs_train", "o-"), ("floor", "x--")):
      label = r["recipe"] + (" (floor)" if kind == "floor" else "")
      ys = [r["by_length"][str(L)][kind]["seq_abs_sum_mean"] for L in lengths]
      axes[0].plot(lengths, np.maximum(ys, 1e-6), style, color=c, label=label)
      top = r["by_length"][str(max(lengths))][kind]
      y = np.asarray(top["bin_abs_diff_mean"], float)
      keep = np.asarray(top["bin_count"]) > 0
      axes[1].plot(np.arange(len(y))[keep], np.maximum(y[keep], 1e-9), style, color=c)
  axes[0].set_xscale("log", base=2), axes[0].set_yscale("log")
  axes[0].set_xlabel("generated tokens"), axes[0].set_ylabel("mean |Σ Δ log p| per sequence")
  axes[0].set_title("sequence log-ratio against length", fontsize=9)
  edges = results[0]["edges"]
  axes[1].set_xticks(range(len(edges)), bin_labels(edges), fontsize=7)
  axes[1].set_yscale("log"), axes[1].set_xlabel("token position")
  axes[1].set_ylabel("mean |Δ log p|"), axes[1].set_title("by position", fontsize=9)
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.legend(loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=72, bbox_inches="tight")
  plt.close(fig)


def main(argv):
  del argv
  bad = [r for r in FLAGS.recipes if r not in RECIPES]
  if bad:
    raise app.UsageError(f"--recipes: unknown {bad}; accepted: {list(RECIPES)}")
  lengths = sorted(int(x) for x in FLAGS.lengths)
  tok = M.load_model_tokenizer(FLAGS.model)
  config, params = M.load_pretrained(FLAGS.model)
  with open(FLAGS.gsm8k, encoding="utf-8") as f:
    questions = [json.loads(line)["question"] for line in f][: FLAGS.prompts]
  prompts = [chat_prompt_ids(tok, user_message(q)) for q in questions]
  width = max(len(p) for p in prompts)
  if width + max(lengths) > config.max_seq_len:
    raise app.UsageError(
      f"prompt width {width} + {max(lengths)} tokens exceeds the model's {config.max_seq_len}"
    )
  print(
    f"{FLAGS.model}: {len(prompts)} prompts x {FLAGS.samples} samples, prompt width {width}, "
    f"{max(lengths)} new tokens, temperature {FLAGS.temperature:g}, stop={FLAGS.stop}",
    flush=True,
  )
  results = []
  for name in FLAGS.recipes:
    results.append(measure(params, config, prompts, tok, name, lengths))
    r = results[-1]
    print(
      f"{name}: sampled in {r['sample_s']:.0f}s, scored in {r['score_s']:.0f}s, "
      f"mean length {r['mean_length']:.0f}",
      flush=True,
    )
  print(table(results, lengths))
  if FLAGS.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump(
        dict(
          model=FLAGS.model,
          prompts=FLAGS.prompts,
          samples=FLAGS.samples,
          temperature=FLAGS.temperature,
          stop=FLAGS.stop,
          seed=FLAGS.seed,
          results=results,
        ),
        f,
        indent=1,
      )
  if FLAGS.plot:
    plot(results, lengths, FLAGS.plot)


if __name__ == "__main__":
  app.run(main)
