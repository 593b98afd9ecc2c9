"""Supervised warm start on a task's gold solutions, so RL starts from a policy that knows the
answer format. Writes checkpoints that `--init_from` of the RL run reads.

It runs like the RL loop: checkpoints every `--ckpt_every` steps (and at the end), and a rerun
of the same command resumes from the newest intact one with the same data order, so a killed
SFT run continues where it stopped and its metric lines are not duplicated. The workdir is
locked, earlier metrics are never deleted, a non-finite update is skipped (and the run stops
after `--max_skipped_steps` such steps in a row), and a change of `--steps` (which sets the
cosine schedule) is refused on resume unless `--allow_schedule_change` (docs/reliability.md).
"""

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
from jetrl.rl.update import all_finite
from jetrl.sampling import pad_prompts, SamplingConfig
from jetrl.train import setup
from jetrl.train.checkpoint import Checkpointer
from jetrl.train.memory import check_step_memory, step_bytes
from jetrl.train.resume import CHANGES_FILE, record_changes, resume_check
from jetrl.train.skips import SkipTracker
from jetrl.train.validation import (SEED_MAX, FlagError, check_float, check_int,
                                    check_task_knobs, check_workdir)
from jetrl.train.workdir import WorkdirLock, make_workdir, start_fresh
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
  workdir: str = _f("", "Output directory (checkpoints, metrics).")
  ckpt_every: int = _f(50, "Checkpoint every N steps (and at the end).")
  keep_ckpts: int = _f(2, "Checkpoints kept.")
  max_skipped_steps: int = _f(5, "Stop with an error after this many non-finite updates in a "
                              "row.")
  overwrite: bool = _f(False, "Start afresh in a workdir that holds metrics but no checkpoint; "
                       "the old files are moved to workdir/previous/<time>/, never deleted.")
  allow_schedule_change: bool = _f(False, "Resume although --steps changed (it sets the "
                                   "cosine schedule); the change is recorded in "
                                   "workdir/config_changes.jsonl.")

  def validate(self) -> "SFTConfig":
    """Raise FlagError (a ValueError) naming the flag for any invalid value."""
    from jetrl.data import TASKS
    from jetrl.models import PRESETS
    if self.task not in TASKS:
      raise FlagError("task", f"{self.task!r} is not accepted; choose one of {list(TASKS)}")
    if self.recipe not in RECIPES:
      raise FlagError("recipe", f"{self.recipe!r} is not accepted; choose one of "
                      f"{list(RECIPES)}")
    if self.model not in PRESETS and not os.path.isdir(self.model):
      raise FlagError("model", f"{self.model!r} is neither a preset ({sorted(PRESETS)}) nor a "
                      "directory")
    check_workdir(self.workdir)
    for k in ("steps", "batch_size", "max_new_tokens", "eval_size", "ckpt_every", "keep_ckpts",
              "max_skipped_steps"):
      check_int(k, getattr(self, k), 1)
    for k in ("n_layers", "warmup_steps", "difficulty", "length"):
      check_int(k, getattr(self, k), 0)
    check_int("seed", self.seed, 0, SEED_MAX)
    check_task_knobs(self.task, self.difficulty, self.length)
    check_float("lr", self.lr, 0.0, 1.0, lo_open=True)
    return self


# Fields that may change when an SFT run resumes (a change of `steps` is checked on its own).
SFT_RESUMABLE_FIELDS = ("steps", "workdir", "eval_size", "ckpt_every", "keep_ckpts",
                        "max_skipped_steps", "overwrite", "allow_schedule_change")


def sft_schedule(cfg: SFTConfig):
  """Warmup, then cosine decay to 5% of the peak over `steps` optimizer steps."""
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1),
                                            max(cfg.steps, cfg.warmup_steps + 1), 0.05 * cfg.lr)


def _solution_batch(tok, problems, width: int, t_max: int):
  prompts = [setup.encode_prompt(tok, p.prompt) for p in problems]
  sols = [setup.encode_completion(tok, p.solution) for p in problems]
  too_long = [len(s) for s in sols if len(s) > t_max]
  if too_long:
    raise FlagError("max_new_tokens", f"a gold solution has {max(too_long)} tokens, more than "
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
  """One optimizer step; a step whose loss, gradients or result is not finite is skipped
  (params and optimizer state returned unchanged, `ok` False)."""
  def loss_fn(p):
    logp, _ = policy_logprobs(p, model_config, batch, precision)
    return -(logp * batch.mask).sum() / jnp.maximum(batch.mask.sum(), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, new_opt = opt.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  ok = jnp.isfinite(loss) & all_finite(grads) & all_finite(new_params) & all_finite(new_opt)
  keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state), loss, optax.tree.norm(grads), ok


def run_sft(cfg: SFTConfig, *, log=print) -> dict:
  """Run (or resume) a supervised warm start; returns the greedy evaluation at the end (also in
  workdir/sft_summary.json). Errors as for `jetrl.train.run`."""
  cfg = cfg.validate()
  make_workdir(cfg.workdir)
  lock = WorkdirLock(cfg.workdir, log) if jax.process_index() == 0 else None
  try:
    return _run_sft(cfg, log)
  finally:
    if lock is not None:
      lock.release()


def _run_sft(cfg: SFTConfig, log) -> dict:
  recipe = get_recipe(cfg.recipe)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  task, width = setup.load_task(cfg.task, difficulty=cfg.difficulty, length=cfg.length,
                                data_path=cfg.data_path, seed=cfg.seed, tok=tok)
  mcfg = setup.model_config(cfg.model, cfg.n_layers, tok, width + cfg.max_new_tokens)
  setup.check_tokenizer(mcfg, tok)
  check_step_memory(step_bytes(mcfg, rows=min(cfg.eval_size, 64),
                               seq_len=width + cfg.max_new_tokens, micro_rows=cfg.batch_size,
                               compute_bytes=4 if cfg.recipe == "fp32" else 2),
                    "--batch_size / --max_new_tokens", processes=jax.process_count())
  params = setup.make_params(cfg.model, mcfg, cfg.seed)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(sft_schedule(cfg), weight_decay=0.0))
  opt_state = opt.init(params)
  # Committed like a restored state, so a resumed run reuses the compiled step.
  params, opt_state = jax.device_put((params, opt_state), jax.local_devices()[0])
  ckpt = Checkpointer(cfg.workdir, cfg.keep_ckpts)
  start, changes = 0, []
  check = resume_check(cfg, ckpt.directory, changes, resumable=SFT_RESUMABLE_FIELDS,
                       schedule="warmup, then cosine decay over --steps",
                       schedule_of=lambda steps: max(steps, cfg.warmup_steps + 1))
  restored = ckpt.restore_latest({"params": params, "opt_state": opt_state}, check, log)
  if restored is not None:
    state, meta = restored
    params, opt_state, start = state["params"], state["opt_state"], int(meta["step"])
    MetricWriter(cfg.workdir, "sft_metrics", tensorboard=False).truncate_after(start)
    record_changes(cfg.workdir, start, changes, log)
    log(f"resumed SFT at step {start}")
  else:
    start_fresh(cfg.workdir, ("sft_metrics.jsonl",), ("sft_summary.json", CHANGES_FILE),
                first_checkpoint=min(cfg.ckpt_every, cfg.steps), overwrite=cfg.overwrite,
                log=log, move=jax.process_index() == 0)
  writer = MetricWriter(cfg.workdir, "sft_metrics", tensorboard=False)
  log(f"jetrl SFT: task={cfg.task} model={cfg.model} ({mcfg.n_layers} layers) steps={cfg.steps} "
      f"batch={cfg.batch_size} recipe={cfg.recipe}")
  progress = Progress(cfg.steps, start)
  skips = SkipTracker(cfg.max_skipped_steps, "Check --lr and the initial params (--model).")
  skipped = 0
  for step in range(start, cfg.steps):
    problems = task.batch("train", step * cfg.batch_size, cfg.batch_size)
    batch = _solution_batch(tok, problems, width, cfg.max_new_tokens)
    params, opt_state, loss, gnorm, ok = sft_step(params, opt_state, batch, model_config=mcfg,
                                                  precision=recipe.train, opt=opt)
    ok = bool(ok)
    skipped += not ok
    done = step + 1 == cfg.steps
    if (step + 1) % 10 == 0 or done:
      writer.write(step + 1, {"loss": loss, "grad_norm": gnorm, "skipped_updates": skipped})
      progress.update(step + 1, {"loss": float(loss)})
    skips.update(step + 1, 0 if ok else 1, 1)
    if (step + 1) % cfg.ckpt_every == 0 or done:
      meta = {"step": step + 1, "kind": "sft", "config": dataclasses.asdict(cfg)}
      ckpt.save(step + 1, {"params": params, "opt_state": opt_state}, meta)
  ckpt.close()
  writer.close()
  t0 = time.time()
  res = setup.evaluate(params, mcfg, task, tok, recipe.rollout, size=cfg.eval_size,
                       max_new_tokens=cfg.max_new_tokens)
  log(f"SFT done: greedy accuracy {res['eval_accuracy']:.3f} on {cfg.eval_size} held-out "
      f"problems ({time.time() - t0:.1f}s)")
  summary = dict(workdir=cfg.workdir, **res)
  with open(os.path.join(cfg.workdir, "sft_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary
