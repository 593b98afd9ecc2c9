"""The trainer's gradient against generated length on a real model: SmolLM2-135M-Instruct on
GSM8K prompts (chat template). Is an FP8 (or bf16) training step biased against a float32 one,
and does that grow with length? How far apart are the importance weights a rollout's rows get?

  python experiments/gradient_length.py --prompts=4 --sampling.n=4 --lengths=128,256,512 \
      --json_out=runs/gradient_length.json --plot=runs/gradient_length.png

No training. Each recipe's rollout samples --sampling.n completions of each of the first
--prompts GSM8K test questions, max(--lengths) new tokens each (the end-of-turn ids do not
stop a row, as in experiments/mismatch_length.py, so every row reaches the budget). Every row
gets an advantage from a reward drawn at random (half of each group's rows 1, the rest 0, in a
random order; GRPO's group normalisation; the same draw for every recipe and length, --seed):
a CPU cannot sample a model of this size
long enough, often enough, for GSM8K's own rewards to separate rows, and what is measured here
is the arithmetic of the step on given rows and advantages, not whether it learns. Then, at
each prefix length L of --lengths (the first L generated tokens of the same rows):

  training step  on the bf16 rollout's rows, each distinct training precision's gradient
                 (`jetrl.study.gradients.trainer_gradient`: the update's first optimizer step,
                 PPO ratio and all) against a float32 forward and backward on the same rows:
                 cosine and |g - g32| / |g32|; with the PPO ratio's old log-probs recomputed
                 (the default) and taken from the differentiated forward (`same_forward`);
                 the fraction of tokens PPO clipped at that first step (where the ratio of two
                 forwards of the same params should be 1)
  noise          the float32 gradient of the batch's first half of prompts against its second
                 half: how far two half-batches of the estimator are apart, the scale any bias
                 is read against
  importance     per recipe, its own rollout's rows under its training forward: the sequence
  weights        ESS / n (`sequence_ess`), the share of tokens TIS (cap 2) truncates, mean
                 |Δ log p| and k3 KL

Every flag is a field of the configuration, named by its path (--model.name: the Hugging Face
folder; --sampling.n, --sampling.temperature; --update.loss, ...); --help lists them.
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
  json_out_field,
  recipes_field,
  smollm2_model,
)
from jetrl import models as M  # noqa: E402
from jetrl.config import SEED_MAX, ConfigError, check_fields, field, node  # noqa: E402
from jetrl.data.prompts import chat_prompt_ids, user_message  # noqa: E402
from jetrl.precision import Precision, get_recipe  # noqa: E402
from jetrl.rl.advantages import compute_advantages  # noqa: E402
from jetrl.rl.batch import make_train_batch  # noqa: E402
from jetrl.rl.correction import importance_weights  # noqa: E402
from jetrl.rl.update import StepSpec, no_grad_logprobs  # noqa: E402
from jetrl.rl.update_config import UpdateConfig  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.study import gradients as G  # noqa: E402
from jetrl.train import ModelSpec  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402

EXCLUDE = ("sampling.max_new_tokens", "sampling.stop_ids", "sampling.prompt_len", *PRESET_ONLY)
FP32 = Precision("float32")
OLD_LOGP = ("recompute", "same_forward")


@dataclasses.dataclass(frozen=True)
class GradientLengthConfig(Tree):
  """experiments/gradient_length.py's settings."""

  model: ModelSpec = smollm2_model()
  gsm8k: str = gsm8k_field()
  prompts: int = field(4, "GSM8K questions (the first ones of the file); at least 2.", lo=2)
  sampling: SamplingConfig = node(
    SamplingConfig(temperature=1.0, n=4),
    "The rollouts: --sampling.n samples per question (at least 2, a group to normalise).",
  )
  lengths: tuple[int, ...] = field((128, 256, 512), "Generated-token prefixes to measure.", lo=1)
  recipes: tuple[str, ...] = recipes_field(("bf16", "fp8_rollout", "jet"))
  update: UpdateConfig = node(  # recompute: as the committed measurements ran
    UpdateConfig(old_logp="recompute"), "The update whose gradient is measured."
  )
  seed: int = field(0, "Seed of the samples and of the random rewards.", lo=0, hi=SEED_MAX)
  json_out: Optional[str] = json_out_field()
  plot: Optional[str] = field(None, "Optional path for the figure (PNG).")

  def __post_init__(self):
    check_fields(self)
    if not self.lengths:
      raise ConfigError("lengths", "give at least one length")
    if self.sampling.n < 2:
      raise ConfigError("sampling.n", "needs at least 2 samples a question (a group)")
    if not self.sampling.temperature > 0:
      raise ConfigError("sampling.temperature", "must be > 0 (it scales the log-probs)")
    if self.update.minibatches != 1 or self.update.kl_coef > 0:
      raise ConfigError(
        "update.minibatches", "the first step's gradient needs 1 minibatch and kl_coef 0"
      )


def random_advantages(rows: int, n: int, seed: int, kind: str) -> jax.Array:
  """Advantages (`kind`, an entry of jetrl.rl.advantages.ADVANTAGE_SPECS) of random rewards
  (the same for every recipe): each group's n rows get n // 2 rewards of 1 and the rest 0, in
  a random order, so that no group's advantages are all 0."""
  rng = np.random.default_rng(seed)
  group = np.array([1.0] * (n // 2) + [0.0] * (n - n // 2), np.float32)
  rewards = np.concatenate([rng.permutation(group) for _ in range(rows // n)])
  return compute_advantages(jnp.asarray(rewards), n, kind)


def prefix_batch(out, advantages, length: int, rows=None):
  """The update batch of a rollout's first `length` generated tokens (of `rows`, all by
  default)."""
  sel = slice(None) if rows is None else rows
  cut = lambda a: np.asarray(a)[sel, :length]
  return make_train_batch(
    np.asarray(out.prompt_tokens)[sel],
    np.asarray(out.prompt_mask)[sel],
    cut(out.tokens),
    cut(out.mask),
    cut(out.logprobs),
    np.asarray(advantages)[sel],
  )


def measure(cfg: GradientLengthConfig, params, mcfg, rollouts, advantages, log=print) -> list:
  """One entry per length: the training steps against float32, the noise scale, and each
  recipe's importance weights."""
  recipes = [get_recipe(n) for n in cfg.recipes]
  trainers = list(dict.fromkeys(r.train for r in recipes))
  name_of = {t: next(r.name for r in recipes if r.train == t) for t in trainers}
  temp = cfg.sampling.temperature
  base = rollouts[get_recipe("bf16").rollout]
  rows = base.tokens.shape[0]
  half = (cfg.prompts // 2) * cfg.sampling.n
  results = []
  for length in sorted(cfg.lengths):
    t0 = time.time()
    b = prefix_batch(base, advantages, length)

    def grad(batch, precision, old_logp=cfg.update.old_logp):
      u = dataclasses.replace(cfg.update, old_logp=old_logp)
      g, clipped = G.trainer_gradient(
        params, batch, model_config=mcfg, cfg=u, precision=precision, temperature=temp
      )
      return G.flat(g), float(clipped)

    g32, _ = grad(b, FP32)
    h1, _ = grad(prefix_batch(base, advantages, length, slice(0, half)), FP32)
    h2, _ = grad(prefix_batch(base, advantages, length, slice(half, rows)), FP32)
    entry = dict(
      length=length,
      tokens=int(np.asarray(b.mask).sum()),
      noise=dict(half_cosine=G.cosine(h1, h2), half_rel_diff=G.relative_difference(h1, h2)),
      trainers={},
      recipes={},
    )
    for t in trainers:
      entry["trainers"][name_of[t]] = {}
      for old in OLD_LOGP:
        g, clipped = grad(b, t, old)
        entry["trainers"][name_of[t]][old] = dict(
          cosine=G.cosine(g, g32),
          rel_diff=G.relative_difference(g, g32),
          clipped=clipped,
          grad_norm=float(np.linalg.norm(g)),
        )
    for r in recipes:
      out = rollouts[r.rollout]
      rb = prefix_batch(out, advantages, length)
      spec = StepSpec(mcfg, cfg.update, r.train, temp, False, length)
      train_lp = no_grad_logprobs(params, rb, spec)
      mask = np.asarray(rb.mask) > 0
      d = (np.asarray(train_lp, np.float64) - np.asarray(rb.rollout_logprobs, np.float64))[mask]
      _, is_m = importance_weights(train_lp, rb.rollout_logprobs, rb.mask, method="tis", cap=2.0)
      entry["recipes"][r.name] = dict(
        sequence_ess=G.sequence_ess(G.sequence_log_ratios(train_lp, rb.rollout_logprobs, mask)),
        tis_truncated=float(is_m["frac_truncated"]),
        abs_diff_mean=float(np.abs(d).mean()),
        kl_k3=float(np.mean(np.exp(-d) - 1 + d)),
      )
    log(
      f"L={length}: half-batch cosine {entry['noise']['half_cosine']:.3f}; "
      + "; ".join(
        f"{n} vs fp32 cos {v['recompute']['cosine']:.4f} / {v['same_forward']['cosine']:.4f}"
        for n, v in entry["trainers"].items()
      )
      + f" ({time.time() - t0:.0f}s)"
    )
    results.append(entry)
  return results


def table(results: list) -> str:
  lines = [
    "| generated tokens | trainer (of recipe) | old log-probs | cos(g, g fp32) | rel. diff to "
    "fp32 | tokens clipped at step 1 | half-batch cos (fp32) | half-batch rel. diff |",
    "|---:|---|---|---:|---:|---:|---:|---:|",
  ]
  for e in results:
    for name, by_old in e["trainers"].items():
      for old, m in by_old.items():
        lines.append(
          f"| {e['length']} | {name} | {old} | {m['cosine']:.5f} | {m['rel_diff']:.4f} | "
          f"{m['clipped']:.2e} | {e['noise']['half_cosine']:.3f} | "
          f"{e['noise']['half_rel_diff']:.3f} |"
        )
  lines += [
    "",
    "| generated tokens | recipe | sequence ESS / n | TIS (cap 2) truncated | mean \\|Δ\\| | "
    "k3 KL |",
    "|---:|---|---:|---:|---:|---:|",
  ]
  for e in results:
    for name, m in e["recipes"].items():
      lines.append(
        f"| {e['length']} | {name} | {m['sequence_ess']:.3f} | {m['tis_truncated']:.2e} | "
        f"{m['abs_diff_mean']:.2e} | {m['kl_k3']:.2e} |"
      )
  return "\n".join(lines)


def plot(results: list, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  lengths = [e["length"] for e in results]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
  for name in results[0]["trainers"]:
    for old, style in zip(OLD_LOGP, ("o-", "s--")):
      ys = [e["trainers"][name][old]["rel_diff"] for e in results]
      axes[0].plot(lengths, ys, style, label=f"{name} trainer, {old}")
  axes[0].plot(
    lengths, [e["noise"]["half_rel_diff"] for e in results], "k:", label="two half-batches"
  )
  axes[0].set_ylabel("|g - g_fp32| / |g_fp32|"), axes[0].set_yscale("log")
  axes[0].set_title("training step against float32, same rows", fontsize=9)
  for name in results[0]["recipes"]:
    axes[1].plot(lengths, [e["recipes"][name]["sequence_ess"] for e in results], "o-", label=name)
  axes[1].set_ylabel("sequence ESS / n"), axes[1].set_ylim(0, 1.05)
  axes[1].set_title("importance weights of each rollout's rows", fontsize=9)
  for ax in axes:
    ax.set_xscale("log", base=2), ax.set_xlabel("generated tokens"), ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=72)
  plt.close(fig)


def run(cfg: GradientLengthConfig) -> None:
  check_model_inputs(cfg.model, cfg.gsm8k)
  t_all = time.time()
  folder = cfg.model.name
  tok = M.load_model_tokenizer(folder)
  mcfg, params = M.load_pretrained(folder)
  with open(cfg.gsm8k, encoding="utf-8") as f:
    questions = [json.loads(line)["question"] for line in f][: cfg.prompts]
  if len(questions) < cfg.prompts:
    raise ConfigError("prompts", f"{cfg.gsm8k} has only {len(questions)} questions")
  prompts = [chat_prompt_ids(tok, user_message(q)) for q in questions]
  width, longest = max(len(p) for p in prompts), max(cfg.lengths)
  if width + longest > mcfg.max_seq_len:
    raise ConfigError(
      "lengths", f"prompt width {width} + {longest} tokens exceeds the model's {mcfg.max_seq_len}"
    )
  sc = dataclasses.replace(
    cfg.sampling,
    max_new_tokens=longest,
    stop_ids=(),
    pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
  )
  print(
    f"{folder}: {len(prompts)} prompts x {sc.n} samples, prompt width {width}, {longest} new "
    f"tokens, temperature {sc.temperature:g}",
    flush=True,
  )
  rollouts = {}
  for name in ("bf16", *cfg.recipes):
    rollout = get_recipe(name).rollout
    if rollout not in rollouts:
      t0 = time.time()
      out = sample(params, mcfg, prompts, jax.random.PRNGKey(cfg.seed), sc, rollout)
      rollouts[rollout] = jax.block_until_ready(out)
      print(f"sampled with {name}'s rollout in {time.time() - t0:.0f}s", flush=True)
  rows = len(prompts) * sc.n
  adv = random_advantages(rows, sc.n, cfg.seed, cfg.update.resolved_advantage)
  results = measure(cfg, params, mcfg, rollouts, adv)
  print(table(results))
  wall = time.time() - t_all
  print(f"({wall:.0f}s)")
  if cfg.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
    with open(cfg.json_out, "w", encoding="utf-8") as f:
      json.dump(dict(config=cfg.to_dict(), results=results, wall_s=wall), f, indent=1)
  if cfg.plot:
    plot(results, cfg.plot)


if __name__ == "__main__":
  main(GradientLengthConfig(), run, doc=__doc__, exclude=EXCLUDE)
