"""The PPO ratio at the update's first step: how far the pre-update forward's log-probs are from
those of the forward the update differentiates, on one batch of rollout rows.

  python experiments/first_step_ratio.py --init_from=runs/grad/sft/mix3_9 --length=9 \
      --batch=2 --json_out=docs/study/c_gradients/first_step_ratio.json

No training. From one checkpoint, the batch `--batch` of `--length` that
experiments/gradient_study.py draws (the same problems and key), sampled with `--rollout`'s
rollout precision, scored and given GRPO advantages; then for each recipe of `--trainers`,
within one program:

- the pre-update forward (`jetrl.rl.update.pre_update`, old log-probs recomputed): the PPO
  ratio's old log-probs under `--update.old_logp=recompute`;
- the forward the update differentiates, in the program of
  `jetrl.study.gradients.trainer_gradient` (the loss's gradient accumulated over micro-batches
  as `jetrl.rl.update.accumulate` does), whose own detached log-probs
  `--update.old_logp=same_forward` would take.

Per trainer: the fraction of the batch's tokens where the two differ at all, where their ratio
exp(differentiated - pre-update) leaves the clip range, and where the clip binds (A < 0 and the
ratio below the range, or A > 0 and above it); the worst tokens (row, position, difference in
nats, ratio, the row's advantage); and, from `jetrl.study.gradients.trainer_gradient`
(recompute) on the same rows, the fraction of tokens its loss clipped (a check that this
program rounds as the trainer's does: it should equal the fraction where the clip binds) and
its gradient norm against float32's.
Every flag is a field of the configuration named by its path; --help lists them.
"""

from __future__ import annotations

import dataclasses
import functools
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
from jetrl.config import SEED_MAX, check_fields, field, node  # noqa: E402
from jetrl.data import get_task  # noqa: E402
from jetrl.precision import Precision, RECIPES, get_recipe  # noqa: E402
from jetrl.rl.advantages import group_advantages  # noqa: E402
from jetrl.rl.agreement import DEFAULT_EDGES  # noqa: E402
from jetrl.rl.batch import make_train_batch  # noqa: E402
from jetrl.rl.objective import loss_terms, total_loss  # noqa: E402
from jetrl.rl.update import StepSpec, TrainState, pre_update  # noqa: E402
from jetrl.rl.update_config import UpdateConfig  # noqa: E402
from jetrl.sampling import SamplingConfig, sample  # noqa: E402
from jetrl.study import gradients as G  # noqa: E402
from jetrl.train import ModelSpec, TaskConfig, pieces  # noqa: E402
from jetrl.train.checkpoint import CheckpointError, load_params_from  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402
from jetrl.train.scoring import score_rollout  # noqa: E402

EXCLUDE = ("sampling.stop_ids", "sampling.prompt_len", "sampling.max_new_tokens")
FP32 = Precision("float32")


@dataclasses.dataclass(frozen=True)
class FirstStepRatioConfig(Tree):
  """experiments/first_step_ratio.py's settings (gradient_study.py's batches)."""

  init_from: Optional[str] = field(None, "Checkpoint directory; none: random init (a smoke test).")
  model: ModelSpec = node(ModelSpec, "The policy model.")
  task: TaskConfig = node(TaskConfig(difficulty=1), "A synthetic task (its length: --length).")
  length: int = field(9, "Task length.", lo=1)
  token_margin: int = field(8, "Generation budget beyond the longest gold completion.", lo=0)
  sampling: SamplingConfig = node(SamplingConfig(temperature=0.5, n=8), "The rollout.")
  update: UpdateConfig = node(UpdateConfig(old_logp="recompute"), "The update (its clip range).")
  prompts: int = field(16, "Prompts per batch.", lo=1)
  batch: int = field(2, "Which batch of the length (0-based, as gradient_study.py).", lo=0)
  rollout: str = field("jet", "The recipe whose rollout samples the rows.", choices=RECIPES)
  trainers: tuple[str, ...] = recipes_field(
    ("bf16", "jet", "jet_exact"), "Recipes whose training step is measured."
  )
  top: int = field(5, "Worst tokens listed per trainer.", lo=1)
  seed: int = field(0, "Seed (problems, keys).", lo=0, hi=SEED_MAX)
  json_out: Optional[str] = json_out_field()

  def __post_init__(self):
    check_fields(self)
    self.task.check_lengths("length", (self.length,))


def _loss_and_logp(params, mb, extra, den, spec):
  """`jetrl.rl.update.micro_loss`'s loss under old_logp="recompute", and the log-probs of the
  forward it differentiates (detached)."""
  logp, ent = spec.logprobs(params, mb, remat=spec.remat)
  nums, _ = loss_terms(spec.cfg, logp, ent, mb.advantages, mb.mask, extra, spec.max_tokens)
  return total_loss(nums, spec.cfg) / den, jax.lax.stop_gradient(logp)


@functools.partial(jax.jit, static_argnames=("model_config", "cfg", "precision", "temperature"))
def two_forwards(params, batch, *, model_config, cfg, precision, temperature):
  """(pre-update log-probs, the differentiated forward's log-probs [rows, T], the gradient):
  the program of `jetrl.study.gradients.trainer_gradient` (the pre-update forward, then the
  loss's gradient accumulated over micro-batches), with the differentiated forward's
  log-probs as one more output."""
  spec = StepSpec(model_config, cfg, precision, temperature, False, batch.targets.shape[1])
  state = TrainState(params=params, opt_state=None)
  extra, _, _ = pre_update(state, batch, spec, bin_edges=DEFAULT_EDGES)
  _, den = spec.aggregate(jnp.zeros_like(batch.mask), batch.mask)
  den = jnp.maximum(den, 1e-8)
  grad_fn = jax.grad(_loss_and_logp, has_aux=True)

  def add(carry, micro):
    g, own = grad_fn(params, micro[0], micro[1], den, spec)
    return jax.tree_util.tree_map(jnp.add, carry, g), own

  n = cfg.micro_batches
  split = jax.tree_util.tree_map(
    lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), (batch, extra)
  )
  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, own = jax.lax.scan(add, zeros, split)
  return extra["old_logp"], own.reshape(batch.targets.shape), grads


def run(cfg: FirstStepRatioConfig) -> None:
  t0 = time.time()
  length, k = cfg.length, cfg.batch
  probe = get_task(cfg.task.name, difficulty=cfg.task.difficulty, length=length, seed=0)
  t_max = int(probe.max_completion_chars) + 1 + cfg.token_margin  # gradient_study.budget
  tok = pieces.make_tokenizer(cfg.model, cfg.task)
  mcfg, params = pieces.make_model(cfg.model, tok, cfg.seed, t_max + 64)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params)
  task = pieces.make_task(dataclasses.replace(cfg.task, length=length), seed=cfg.seed)
  ids = pieces.token_ids(tok)
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
  u, temp, n = cfg.update, cfg.sampling.temperature, cfg.sampling.n
  out = sample(params, mcfg, prompts, key, sc, get_recipe(cfg.rollout).rollout)
  rewards, correct, _, _ = score_rollout(task, tok, problems, out, n)
  adv = group_advantages(jnp.asarray(rewards), n, normalize_std=u.normalize_std)
  b = make_train_batch(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv)
  mask = np.asarray(b.mask) > 0
  adv_rows = np.asarray(adv, np.float64)
  lo, hi = 1.0 - u.resolved_clip_low, 1.0 + u.resolved_clip_high
  g32, _ = G.trainer_gradient(params, b, model_config=mcfg, cfg=u, precision=FP32, temperature=temp)
  norm32 = float(np.linalg.norm(G.flat(g32)))
  result = dict(
    length=length,
    batch=k,
    rollout=cfg.rollout,
    rows=int(mask.shape[0]),
    tokens=int(mask.sum()),
    accuracy=float(np.mean(correct)),
    clip_range=[lo, hi],
    grad_norm_float32=norm32,
    trainers={},
  )
  print(f"length {length} batch {k}: {cfg.rollout}'s rollout, {int(mask.sum())} tokens")
  for name in cfg.trainers:
    prec = get_recipe(name).train
    pre, own, _ = two_forwards(
      params, b, model_config=mcfg, cfg=u, precision=prec, temperature=temp
    )
    d = np.asarray(own, np.float64) - np.asarray(pre, np.float64)
    d = np.where(mask, d, 0.0)
    ratio = np.exp(d)
    outside = mask & ((ratio < lo) | (ratio > hi))
    a = adv_rows[:, None]
    binds = mask & (((a < 0) & (ratio < lo)) | ((a > 0) & (ratio > hi)))  # the clip binds
    order = np.argsort(-np.abs(d), axis=None)[: cfg.top]
    worst = []
    for flat_i in order:
      r, t = np.unravel_index(flat_i, d.shape)
      worst.append(
        dict(
          row=int(r),
          position=int(t),
          nats=float(d[r, t]),
          ratio=float(ratio[r, t]),
          advantage=float(adv_rows[r]),
        )
      )
    g, clipped = G.trainer_gradient(
      params, b, model_config=mcfg, cfg=u, precision=prec, temperature=temp
    )
    norm = float(np.linalg.norm(G.flat(g)))
    result["trainers"][name] = dict(
      differ=float((mask & (d != 0)).sum() / mask.sum()),
      outside_clip_range=float(outside.sum() / mask.sum()),
      clip_binds=float(binds.sum() / mask.sum()),
      clipped_by_the_loss=float(clipped),
      worst=worst,
      grad_norm=norm,
      grad_norm_over_float32=norm / norm32 if norm32 > 0 else float("nan"),
    )
    w = worst[0]
    print(
      f"  {name}: tokens differing {result['trainers'][name]['differ']:.4f}, outside the clip "
      f"range {result['trainers'][name]['outside_clip_range']:.5f}; worst: row {w['row']} "
      f"position {w['position']}, {w['nats']:+.3f} nats (ratio {w['ratio']:.3f}), advantage "
      f"{w['advantage']:+.3f}; gradient norm {norm:.4g} "
      f"({result['trainers'][name]['grad_norm_over_float32']:.2f}x float32's)"
    )
  result["wall_s"] = time.time() - t0
  print(f"({result['wall_s']:.0f}s)")
  if cfg.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.json_out)), exist_ok=True)
    with open(cfg.json_out, "w") as f:
      json.dump(dict(config=cfg.to_dict(), result=result), f, indent=1)


if __name__ == "__main__":
  main(FirstStepRatioConfig(), run, doc=__doc__, exclude=EXCLUDE, errors=(CheckpointError,))
