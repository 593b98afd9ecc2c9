"""Rollout/training mismatch against generated length on a real model: SmolLM2-135M-Instruct on
GSM8K prompts (chat template), per recipe, against the recipe's own train-vs-train floor.

  python experiments/mismatch_length.py --prompts=2 --sampling.n=2 --lengths=128,512,2048 \
      --json_out=runs/mismatch_length.json --plot=runs/mismatch_length.png

For each recipe it samples --sampling.n completions of each of the first --prompts GSM8K test
questions with `recipe.rollout`, max(--lengths) new tokens each (temperature
--sampling.temperature; with --stop=false, the default, the end-of-turn ids do not stop a row,
so that every row reaches the budget: past the model's own end of answer the text is its free
continuation).
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

Every flag is a field of the configuration, named by its path (--model.name: the Hugging Face
folder; --sampling.n, --sampling.temperature, --sampling.top_k, ...: experiments/train.py's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers

from _fields import (  # noqa: E402
  PRESET_ONLY,
  check_model_inputs,
  gsm8k_field,
  recipes_field,
  smollm2_model,
)
from _mismatch_common import rollout_batch, train_logprobs  # noqa: E402
from jetrl import models as M  # noqa: E402
from jetrl.config import SEED_MAX, ConfigError, check_fields, field, node  # noqa: E402
from jetrl.data.prompts import chat_prompt_ids, user_message  # noqa: E402
from jetrl.precision import get_recipe  # noqa: E402
from jetrl.rl import metrics as K  # noqa: E402
from jetrl.rl.agreement import DEFAULT_EDGES, agreement_metrics  # noqa: E402
from jetrl.rl.batch import make_train_batch  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.train import ModelSpec  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

# The flags of this script before it took the configuration's.
RENAMED = {"model": "model.name", "samples": "sampling.n", "temperature": "sampling.temperature"}
# Set by the script (the budget: the longest of --lengths; the stop and pad ids: the
# tokenizer's, with --stop) or not used (a Hugging Face folder is loaded whole).
EXCLUDE = (
  "sampling.max_new_tokens",
  "sampling.stop_ids",
  "sampling.prompt_len",
  *PRESET_ONLY,
)
# The agreement metrics reported (jetrl.rl.agreement; names in jetrl.rl.metrics).
REPORTED = (
  K.ABS_DIFF_MEAN,
  K.ABS_DIFF_MAX,
  K.SEQ_ABS_SUM_MEAN,
  K.KL_K3,
  K.RATIO_OUT_FRAC,
  K.N_TOKENS,
  K.BIN_ABS_DIFF_MEAN,
  K.BIN_COUNT,
)


@dataclasses.dataclass(frozen=True)
class LengthConfig(Tree):
  """experiments/mismatch_length.py's settings."""

  model: ModelSpec = smollm2_model()
  gsm8k: str = gsm8k_field()
  prompts: int = field(2, "GSM8K questions (the first ones of the file).", lo=1)
  sampling: SamplingConfig = node(
    SamplingConfig(temperature=1.0, n=2),
    "The rollouts: --sampling.n samples per question; the temperature is the log-probs' too.",
  )
  lengths: tuple[int, ...] = field((128, 512, 2048), "Generated-token prefixes to report.", lo=1)
  recipes: tuple[str, ...] = recipes_field(("bf16", "fp8_rollout", "jet"))
  stop: bool = field(False, "Stop a row at the model's end-of-turn ids.")
  seed: int = field(0, "Sampling seed.", lo=0, hi=SEED_MAX)
  floor_pad: int = field(64, "Masked tokens appended to each row for the floor.", lo=0)
  json_out: Optional[str] = field(None, "Write the results as JSON here.")
  plot: Optional[str] = field(None, "Write a PNG figure here.")

  def __post_init__(self):
    check_fields(self)
    if not self.lengths:
      raise ConfigError("lengths", "give at least one length")
    if not self.sampling.temperature > 0:
      raise ConfigError("sampling.temperature", "must be > 0 (it scales the log-probs)")


_ROLLOUTS: dict = {}


def measure(cfg: LengthConfig, params, config, prompts, tok, name: str) -> dict:
  """The rollout-vs-train and floor metrics of one recipe at each prefix length. Recipes with
  the same rollout precision (fp8_rollout and jet) score the same samples."""
  recipe = get_recipe(name)
  lengths = sorted(cfg.lengths)
  t0 = time.time()
  sc = dataclasses.replace(
    cfg.sampling,
    max_new_tokens=max(lengths),
    stop_ids=M.stop_ids(tok) if cfg.stop else (),
    pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
  )
  if recipe.rollout not in _ROLLOUTS:
    out = sample(params, config, prompts, jax.random.PRNGKey(cfg.seed), sc, recipe.rollout)
    _ROLLOUTS[recipe.rollout] = jax.block_until_ready(out)
  out = _ROLLOUTS[recipe.rollout]
  t_sample = time.time() - t0
  rows = out.tokens.shape[0]
  batch = rollout_batch(out)
  logp = train_logprobs(config, recipe.train, sc)
  t0 = time.time()
  whole = logp(params, batch)
  # The floor: each row alone, its sequence right-padded by --floor_pad masked tokens (the same
  # math over other shapes: one row instead of all, a longer sequence).
  pad = cfg.floor_pad
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
    alone.append(logp(params, one)[:, : out.tokens.shape[1]])
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
      entry[kind] = {k: np.asarray(K.read(m, k)).tolist() for k in REPORTED}
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
      d, fd = a[K.ABS_DIFF_MEAN], f[K.ABS_DIFF_MEAN]
      ratio = d / fd if fd > 0 else float("inf")
      lines.append(
        f"| {r['recipe']} | {L} | {d:.2e} | {a[K.SEQ_ABS_SUM_MEAN]:.2f} | "
        f"{a[K.KL_K3]:.2e} | {a[K.RATIO_OUT_FRAC]:.3f} | {fd:.2e} | "
        f"{f[K.SEQ_ABS_SUM_MEAN]:.2f} | {f[K.KL_K3]:.2e} | {ratio:.1f} |"
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
      ys = [r["by_length"][str(L)][kind][K.SEQ_ABS_SUM_MEAN] for L in lengths]
      axes[0].plot(lengths, np.maximum(ys, 1e-6), style, color=c, label=label)
      top = r["by_length"][str(max(lengths))][kind]
      y = np.asarray(top[K.BIN_ABS_DIFF_MEAN], float)
      keep = np.asarray(top[K.BIN_COUNT]) > 0
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


def run(cfg: LengthConfig) -> None:
  check_model_inputs(cfg.model, cfg.gsm8k)
  lengths = sorted(cfg.lengths)
  folder = cfg.model.name
  tok = M.load_model_tokenizer(folder)
  config, params = M.load_pretrained(folder)
  with open(cfg.gsm8k, encoding="utf-8") as f:
    questions = [json.loads(line)["question"] for line in f][: cfg.prompts]
  prompts = [chat_prompt_ids(tok, user_message(q)) for q in questions]
  width = max(len(p) for p in prompts)
  if width + max(lengths) > config.max_seq_len:
    raise ConfigError(
      "lengths",
      f"prompt width {width} + {max(lengths)} tokens exceeds the model's {config.max_seq_len}",
    )
  print(
    f"{folder}: {len(prompts)} prompts x {cfg.sampling.n} samples, prompt width {width}, "
    f"{max(lengths)} new tokens, temperature {cfg.sampling.temperature:g}, stop={cfg.stop}",
    flush=True,
  )
  results = []
  for name in cfg.recipes:
    results.append(measure(cfg, params, config, prompts, tok, name))
    r = results[-1]
    print(
      f"{name}: sampled in {r['sample_s']:.0f}s, scored in {r['score_s']:.0f}s, "
      f"mean length {r['mean_length']:.0f}",
      flush=True,
    )
  print(table(results, lengths))
  if cfg.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
    with open(cfg.json_out, "w") as f:
      json.dump(
        dict(
          model=folder,
          prompts=cfg.prompts,
          samples=cfg.sampling.n,
          temperature=cfg.sampling.temperature,
          stop=cfg.stop,
          seed=cfg.seed,
          results=results,
        ),
        f,
        indent=1,
      )
  if cfg.plot:
    plot(results, lengths, cfg.plot)


if __name__ == "__main__":
  main(LengthConfig(), run, doc=__doc__, exclude=EXCLUDE, renamed=RENAMED)
