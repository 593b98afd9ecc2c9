"""What the rollout/training mismatch and FP8 training arithmetic do to the trainer's gradient.

  python experiments/gradient_study.py --init_from=runs/grad/sft/mix3_9 --lengths=3,9 \
      --batches=4 --json_out=runs/gradients.json --plot=runs/gradients.png

No training: from one checkpoint, at each task length and for each of `--batches` batches
(`--prompts` prompts x `--sampling.n` samples, the study's RL step), with the batch's own key:

- the training forward's own rows: for every training precision of the recipes, the rows
  that forward samples with the sampler's random numbers of that key
  (`jetrl.sampling.reference.resample_with_forward`), and a second set with an independent
  key (the split-half baseline: how far two batches of the same estimator are apart);
- per recipe: its rollout's rows with the same key; the trainer's gradient on them
  (`jetrl.study.gradients.trainer_gradient`, the update's first optimizer step) against the
  gradient on the training forward's own rows of the same key (the coupled pair: they differ
  only where the rollout's rounding changed a draw); the importance weights of its rows
  (sequence ESS, the TIS truncation rate at cap 2, mean |Δ log p|, k3 KL);
- per training precision: its gradient against a float32 forward and backward on the same
  rows (is the FP8 or bf16 training step biased, and does that grow with length?).

Every flag is a field of the configuration named by its path (--task.difficulty,
--sampling.n, --sampling.temperature, --update.loss, ...); --help lists them.
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

from _fields import json_out_field, recipes_field  # noqa: E402
from jetrl.config import SEED_MAX, ConfigError, check_fields, field, node  # noqa: E402
from jetrl.data import get_task  # noqa: E402
from jetrl.precision import Precision, get_recipe  # noqa: E402
from jetrl.rl.advantages import compute_advantages  # noqa: E402
from jetrl.rl.batch import make_train_batch  # noqa: E402
from jetrl.rl.correction import importance_weights  # noqa: E402
from jetrl.rl.update import StepSpec, no_grad_logprobs  # noqa: E402
from jetrl.rl.update_config import UpdateConfig  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.sampling.reference import resample_with_forward  # noqa: E402
from jetrl.study import gradients as G  # noqa: E402
from jetrl.train import ModelSpec, TaskConfig, pieces  # noqa: E402
from jetrl.train.checkpoint import CheckpointError, load_params_from  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402
from jetrl.train.scoring import score_rollout  # noqa: E402

EXCLUDE = ("sampling.stop_ids", "sampling.prompt_len", "sampling.max_new_tokens")
FP32 = Precision("float32")
DEFAULT_RECIPES = (
  "bf16",
  "fp8_rollout",
  "fp8_rollout_tensor",
  "fp8_rollout_e5m2",
  "jet",
  "jet_exact",
  "jet_exact_rollout",
  "jet_exact_train",
)


@dataclasses.dataclass(frozen=True)
class GradientStudyConfig(Tree):
  """experiments/gradient_study.py's settings."""

  init_from: Optional[str] = field(
    None, "Checkpoint directory (an SFT or RL workdir); none: random init (a smoke test)."
  )
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(TaskConfig(difficulty=1), "A synthetic task (its length: --lengths).")
  lengths: tuple[int, ...] = field((3, 9), "Task lengths to measure at.")
  token_margin: int = field(8, "Generation budget beyond the longest gold completion.", lo=0)
  sampling: SamplingConfig = node(SamplingConfig(temperature=0.5, n=8), "The rollouts.")
  update: UpdateConfig = node(  # recompute: as the committed measurements ran
    UpdateConfig(old_logp="recompute"), "The update whose gradient is measured."
  )
  prompts: int = field(16, "Prompts per batch.", lo=1)
  batches: int = field(4, "Batches (keys and problems) per length.", lo=1)
  recipes: tuple[str, ...] = recipes_field(DEFAULT_RECIPES)
  max_passes: int = field(
    0, "Most forward passes of the training forward's own rows (0: the budget + 1).", lo=0
  )
  seed: int = field(0, "Seed (problems, keys).", lo=0, hi=SEED_MAX)
  json_out: Optional[str] = json_out_field()
  plot: Optional[str] = field(None, "Optional path for the figure (PNG).")

  def __post_init__(self):
    check_fields(self)
    if not self.lengths:
      raise ConfigError("lengths", "needs at least one length")
    self.task.check_lengths("lengths", self.lengths)
    if self.update.minibatches != 1 or self.update.kl_coef > 0:
      raise ConfigError(
        "update.minibatches", "the first step's gradient needs 1 minibatch and kl_coef 0"
      )


def budget(cfg: GradientStudyConfig, length: int) -> int:
  task = get_task(cfg.task.name, difficulty=cfg.task.difficulty, length=int(length), seed=0)
  return int(task.max_completion_chars) + 1 + cfg.token_margin


def _mean_sd(xs):
  xs = np.asarray(xs, np.float64)
  return {"mean": float(xs.mean()), "sd": float(xs.std(ddof=1)) if xs.size > 1 else 0.0}


def measure_length(cfg, length, params, mcfg, tok, log=print) -> dict:
  task = pieces.make_task(dataclasses.replace(cfg.task, length=length), seed=cfg.seed)
  ids = pieces.token_ids(tok)
  t_max = budget(cfg, length)
  recipes = [get_recipe(n) for n in cfg.recipes]
  trainers = list(dict.fromkeys(r.train for r in recipes))  # distinct, in order
  name_of = {t: next(r.name for r in recipes if r.train == t) for t in trainers}
  u, temp, n = cfg.update, cfg.sampling.temperature, cfg.sampling.n
  passes_cap = cfg.max_passes or t_max + 1
  per = {r.name: [] for r in recipes}
  per_t = {name_of[t]: [] for t in trainers}
  for k in range(cfg.batches):
    problems = task.batch("train", k * cfg.prompts, cfg.prompts)
    prompts = [pieces.encode_prompt(tok, p.prompt) for p in problems]
    sc = dataclasses.replace(
      cfg.sampling,
      max_new_tokens=t_max,
      stop_ids=ids.stop,
      pad_id=ids.pad,
      prompt_len=pieces.prompt_width(prompts),
    )
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1000 * length + k)
    key_b = jax.random.fold_in(key, 1)

    def batch_of(out):
      rewards, correct, _, _ = score_rollout(task, tok, problems, out, n)
      adv = compute_advantages(jnp.asarray(rewards), n, u.resolved_advantage)
      b = make_train_batch(
        out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv
      )
      return b, float(np.mean(correct)), float(np.mean(np.all(np.reshape(adv, (-1, n)) == 0, 1)))

    def grad(b, precision):
      g, clipped = G.trainer_gradient(
        params, b, model_config=mcfg, cfg=u, precision=precision, temperature=temp
      )
      return G.flat(g), float(clipped)

    refs = {}
    for t in trainers:
      t0 = time.time()
      own = {}
      for label, kk in (("a", key), ("b", key_b)):
        start = sample(params, mcfg, prompts, kk, sc, t.forward)
        res = resample_with_forward(
          params, start, kk, model_config=mcfg, config=sc, precision=t, max_passes=passes_cap
        )
        if not bool(res.converged):
          log(f"  {name_of[t]}: the training forward's rows did not converge in {passes_cap}")
        b, acc, flat_groups = batch_of(res.rollout)
        g, clipped = grad(b, t)
        own[label] = dict(
          out=res.rollout,
          batch=b,
          g=g,
          clipped=clipped,
          passes=int(res.passes),
          acc=acc,
          flat=flat_groups,
        )
      g32, clipped32 = grad(own["a"]["batch"], FP32)
      ga, gb = own["a"]["g"], own["b"]["g"]
      refs[t] = own["a"]
      per_t[name_of[t]].append(
        dict(
          split_half_cosine=G.cosine(ga, gb),
          split_half_rel_diff=G.relative_difference(ga, gb),
          vs_fp32_cosine=G.cosine(ga, g32),
          vs_fp32_rel_diff=G.relative_difference(ga, g32),
          grad_norm=float(np.linalg.norm(ga)),
          clipped=own["a"]["clipped"],
          clipped_fp32=clipped32,
          passes=max(own["a"]["passes"], own["b"]["passes"]),
          accuracy=own["a"]["acc"],
          flat_groups=own["a"]["flat"],
        )
      )
      log(
        f"  L{length} batch {k} trainer of {name_of[t]}: split-half cos "
        f"{per_t[name_of[t]][-1]['split_half_cosine']:.3f}, vs fp32 cos "
        f"{per_t[name_of[t]][-1]['vs_fp32_cosine']:.4f} ({time.time() - t0:.0f}s)"
      )
    for r in recipes:
      out = sample(params, mcfg, prompts, key, sc, r.rollout)
      b, acc, _ = batch_of(out)
      g, clipped = grad(b, r.train)
      ref = refs[r.train]
      spec = StepSpec(mcfg, u, r.train, temp, False, t_max)
      train_lp = no_grad_logprobs(params, b, spec)
      mask = np.asarray(out.mask)
      d = (np.asarray(train_lp) - np.asarray(out.logprobs))[mask]
      _, is_m = importance_weights(train_lp, b.rollout_logprobs, b.mask, method="tis", cap=2.0)
      same = np.all(np.asarray(out.tokens) == np.asarray(ref["out"].tokens), axis=1)
      per[r.name].append(
        dict(
          vs_own_cosine=G.cosine(g, ref["g"]),
          vs_own_rel_diff=G.relative_difference(g, ref["g"]),
          rows_identical=float(same.mean()),
          abs_diff_mean=float(np.abs(d).mean()),
          kl_k3=float(np.mean(np.exp(-d) - 1 + d)),
          sequence_ess=G.sequence_ess(G.sequence_log_ratios(train_lp, out.logprobs, out.mask)),
          tis_truncated=float(is_m["frac_truncated"]),
          clipped=clipped,
          accuracy=acc,
        )
      )
      last = per[r.name][-1]
      log(
        f"  L{length} batch {k} {r.name}: cos to own rows {last['vs_own_cosine']:.4f}, rows "
        f"identical {last['rows_identical']:.2f}, ESS {last['sequence_ess']:.3f}"
      )
  agg = lambda rows: {key: _mean_sd([row[key] for row in rows]) for key in rows[0]}
  return dict(
    length=length,
    max_new_tokens=t_max,
    recipes={name: agg(rows) for name, rows in per.items()},
    trainers={name: agg(rows) for name, rows in per_t.items()},
    per_batch=dict(recipes=per, trainers=per_t),
  )


def table(results) -> str:
  lines = [
    "| length | recipe | rows identical to the trainer's own | cos(g, g own rows) | "
    "rel. diff | split-half cos (trainer) | split-half rel. diff | seq. ESS | TIS truncated "
    "| mean abs Δ | k3 KL |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for res in results:
    for name, m in res["recipes"].items():
      t = res["trainers"][_trainer_name(res, name)]
      lines.append(
        f"| {res['length']} | {name} | {m['rows_identical']['mean']:.3f} | "
        f"{m['vs_own_cosine']['mean']:.4f} | {m['vs_own_rel_diff']['mean']:.3f} | "
        f"{t['split_half_cosine']['mean']:.3f} | {t['split_half_rel_diff']['mean']:.3f} | "
        f"{m['sequence_ess']['mean']:.3f} | {m['tis_truncated']['mean']:.2e} | "
        f"{m['abs_diff_mean']['mean']:.2e} | {m['kl_k3']['mean']:.2e} |"
      )
  lines += [
    "",
    "| length | trainer (of recipe) | cos(g, g fp32) | rel. diff to fp32 | tokens clipped "
    "at step 1 | fp32: clipped | grad norm | passes |",
    "|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for res in results:
    for name, m in res["trainers"].items():
      lines.append(
        f"| {res['length']} | {name} | {m['vs_fp32_cosine']['mean']:.5f} | "
        f"{m['vs_fp32_rel_diff']['mean']:.4f} | {m['clipped']['mean']:.2e} | "
        f"{m['clipped_fp32']['mean']:.2e} | {m['grad_norm']['mean']:.3g} | "
        f"{m['passes']['mean']:.1f} |"
      )
  return "\n".join(lines)


def _trainer_name(res, recipe_name) -> str:
  train = get_recipe(recipe_name).train
  return next(n for n in res["trainers"] if get_recipe(n).train == train)


def run(cfg: GradientStudyConfig) -> None:
  tok = pieces.make_tokenizer(cfg.model, cfg.task)
  longest = max(budget(cfg, L) for L in cfg.lengths)
  mcfg, params = pieces.make_model(cfg.model, tok, cfg.seed, longest + 64)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params)
  results = []
  t0 = time.time()
  for length in cfg.lengths:
    print(f"length {length} ({budget(cfg, length)} new tokens at most)", flush=True)
    results.append(measure_length(cfg, length, params, mcfg, tok))
  print(table(results))
  print(f"({time.time() - t0:.0f}s)")
  if cfg.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
    with open(cfg.json_out, "w") as f:
      json.dump(dict(config=cfg.to_dict(), results=results, wall_s=time.time() - t0), f, indent=1)
  if cfg.plot:
    from jetrl.study.plots import gradient_figure  # noqa: PLC0415

    gradient_figure(results, cfg.plot)


if __name__ == "__main__":
  main(GradientStudyConfig(), run, doc=__doc__, exclude=EXCLUDE, errors=(CheckpointError,))
