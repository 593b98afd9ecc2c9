"""Supervised warm start on a task's gold solutions, so RL starts from a policy that knows the
answer format. Writes a checkpoint that `--init_from` of the RL run reads."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jetrl.precision import RECIPES, get_recipe
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.sampling import pad_prompts, SamplingConfig
from jetrl.train import setup
from jetrl.train.checkpoint import Checkpointer, check_compatible
from jetrl.train.writers import MetricWriter, Progress


def _f(default, help_text):
  return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  model: str = _f("tiny", "A model preset name or an HF checkpoint directory.")
  n_layers: int = _f(0, "Override the preset's number of layers (0: keep).")
  task: str = _f("addition", "Task whose gold solutions are the targets.")
  difficulty: int = _f(2, "Synthetic task difficulty knob.")
  length: int = _f(1, "Synthetic task length knob.")
  data_path: str = _f("", "Local data for dataset tasks.")
  recipe: str = _f("bf16", f"Precision recipe of the SFT step: {list(RECIPES)}.")
  steps: int = _f(300, "Optimizer steps.")
  batch_size: int = _f(32, "Problems per step.")
  lr: float = _f(1e-3, "Peak learning rate (warmup then cosine decay).")
  warmup_steps: int = _f(20, "Warmup steps.")
  max_new_tokens: int = _f(64, "Generation budget for the greedy evaluation; longer gold "
                           "solutions are an error.")
  eval_size: int = _f(64, "Held-out problems for the greedy evaluation at the end.")
  seed: int = _f(0, "Random seed.")
  workdir: str = _f("", "Output directory (checkpoint, metrics).")

  def validate(self) -> "SFTConfig":
    from jetrl.data import TASKS
    if self.task not in TASKS:
      raise ValueError(f"--task: {self.task!r} is not accepted; choose one of {list(TASKS)}")
    if self.recipe not in RECIPES:
      raise ValueError(f"--recipe: {self.recipe!r} is not accepted; choose one of {list(RECIPES)}")
    if not self.workdir:
      raise ValueError("--workdir: is required")
    for k in ("steps", "batch_size", "max_new_tokens", "eval_size"):
      if getattr(self, k) < 1:
        raise ValueError(f"--{k}: must be >= 1, got {getattr(self, k)}")
    if not self.lr > 0:
      raise ValueError(f"--lr: must be > 0, got {self.lr}")
    return self


def _solution_batch(tok, problems, width: int, t_max: int):
  prompts = [setup.encode_prompt(tok, p.prompt) for p in problems]
  sols = [setup.encode_completion(tok, p.solution) for p in problems]
  too_long = [len(s) for s in sols if len(s) > t_max]
  if too_long:
    raise ValueError(f"--max_new_tokens: a gold solution has {max(too_long)} tokens, more than "
                     f"the budget {t_max}; raise --max_new_tokens")
  ids = setup.token_ids(tok)
  ptok, pmask = pad_prompts(prompts, SamplingConfig(max_new_tokens=t_max, prompt_len=width,
                                                    pad_id=ids.pad), 1 << 30, 1 << 30)
  stok = np.full((len(sols), t_max), ids.pad, np.int32)
  smask = np.zeros((len(sols), t_max), bool)
  for i, s in enumerate(sols):
    stok[i, :len(s)] = s
    smask[i, :len(s)] = True
  zeros = np.zeros((len(sols), t_max), np.float32)
  return make_train_batch(ptok, pmask, stok, smask, zeros, np.zeros(len(sols), np.float32))


@functools.partial(jax.jit, static_argnames=("model_config", "precision", "opt"),
                   donate_argnames=("params", "opt_state"))
def sft_step(params, opt_state, batch, *, model_config, precision, opt):
  def loss_fn(p):
    logp, _ = policy_logprobs(p, model_config, batch, precision)
    return -(logp * batch.mask).sum() / jnp.maximum(batch.mask.sum(), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


def run_sft(cfg: SFTConfig, *, log=print) -> dict:
  cfg = cfg.validate()
  recipe = get_recipe(cfg.recipe)
  task = setup.make_task(cfg.task, difficulty=cfg.difficulty, length=cfg.length,
                         data_path=cfg.data_path, seed=cfg.seed)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  probe = [setup.encode_prompt(tok, p.prompt) for p in task.batch("train", 0, 64)]
  width = setup.prompt_width(probe) + 16
  mcfg, params = setup.make_model(cfg.model, cfg.n_layers, tok, cfg.seed, width + cfg.max_new_tokens)
  sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1),
                                             max(cfg.steps, cfg.warmup_steps + 1), 0.05 * cfg.lr)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  opt_state = opt.init(params)
  ckpt = Checkpointer(cfg.workdir, keep=1)
  writer = MetricWriter(cfg.workdir, "sft_metrics", tensorboard=False)
  start = 0
  if ckpt.latest_step() is not None:
    meta = ckpt.restore_meta(ckpt.latest_step())
    check_compatible(meta, cfg, ckpt.directory)
    state, meta = ckpt.restore(ckpt.latest_step(), {"params": params, "opt_state": opt_state})
    params, opt_state, start = state["params"], state["opt_state"], int(meta["step"])
    log(f"resumed SFT at step {start}")
  log(f"jetrl SFT: task={cfg.task} model={cfg.model} ({mcfg.n_layers} layers) steps={cfg.steps} "
      f"batch={cfg.batch_size} recipe={cfg.recipe}")
  progress = Progress(cfg.steps, start)
  for step in range(start, cfg.steps):
    problems = task.batch("train", step * cfg.batch_size, cfg.batch_size)
    batch = _solution_batch(tok, problems, width, cfg.max_new_tokens)
    params, opt_state, loss, gnorm = sft_step(params, opt_state, batch, model_config=mcfg,
                                              precision=recipe.train, opt=opt)
    if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
      writer.write(step + 1, {"loss": loss, "grad_norm": gnorm})
      progress.update(step + 1, {"loss": float(loss)})
  if start < cfg.steps:
    meta = {"step": cfg.steps, "kind": "sft", "config": dataclasses.asdict(cfg)}
    ckpt.save(cfg.steps, {"params": params, "opt_state": opt_state}, meta)
  ckpt.close()
  t0 = time.time()
  res = setup.evaluate(params, mcfg, task, tok, recipe.rollout, size=cfg.eval_size,
                       max_new_tokens=cfg.max_new_tokens)
  log(f"SFT done: greedy accuracy {res['eval_accuracy']:.3f} on {cfg.eval_size} held-out "
      f"problems ({time.time() - t0:.1f}s)")
  summary = dict(workdir=cfg.workdir, **res)
  with open(os.path.join(cfg.workdir, "sft_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary
