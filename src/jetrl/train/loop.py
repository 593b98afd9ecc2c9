"""The RL loop: prompts -> sampler (recipe.rollout) -> rewards -> advantages -> update
(recipe.train) -> metrics -> periodic greedy evaluation -> checkpoint.

`run(config)` is what `experiments/train.py` calls; it is importable from notebooks.
Rerunning the same config on the same workdir resumes from the latest intact checkpoint; PRNG
keys are derived from (seed, step), so a resumed run reproduces an uninterrupted one.

Before anything compiles, the flags, the tokenizer against the model, the memory a step needs
and the device mesh are checked (a FlagError names the flag); the workdir is locked for the
run, and earlier metrics in it are never deleted. A run whose updates are all skipped for
`--max_skipped_steps` steps in a row stops with an error (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import parallel
from jetrl.precision import get_recipe
from jetrl.rl import (DEFAULT_EDGES, UpdateConfig, dynamic_sampling_mask, group_advantages,
                      init_train_state, make_train_batch, overlong_penalty, truncation_mask,
                      update_step)
from jetrl.rl.update import TrainState
from jetrl.sampling import STOP_LENGTH, SamplingConfig, sample
from jetrl.train import resume, setup
from jetrl.train.checkpoint import Checkpointer, load_params_from
from jetrl.train.config import TrainConfig, schedule_key
from jetrl.train.memory import check_step_memory, step_bytes
from jetrl.train.resume import CHANGES_FILE, record_changes
from jetrl.train.skips import SkipTracker
from jetrl.train.validation import FlagError
from jetrl.train.workdir import WorkdirLock, make_workdir, start_fresh
from jetrl.train.writers import MetricWriter, Progress, read_jsonl


def update_config(cfg: TrainConfig) -> UpdateConfig:
  return UpdateConfig(
      loss=cfg.loss, clip_low=cfg.clip_low,
      clip_high=None if cfg.clip_high == -1.0 else cfg.clip_high,
      max_tokens=cfg.max_new_tokens, kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef,
      is_method=cfg.is_correction, is_cap=cfg.is_cap, old_logp=cfg.old_logp,
      ppo_epochs=cfg.ppo_epochs, minibatches=cfg.minibatches, micro_batches=cfg.micro_batches,
      lr=cfg.lr, schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
      weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
      temperature=cfg.temperature, master_dtype=cfg.master_dtype)


def _state_tree(state: TrainState) -> dict:
  return {k: v for k, v in state._asdict().items() if v is not None}


def _bin_edges(max_new_tokens: int) -> tuple[int, ...]:
  return tuple(e for e in DEFAULT_EDGES if e < max_new_tokens) or (0,)


RUN_FILES = ("summary.json", "config.json", CHANGES_FILE, "tb", "plots")


def check_memory(cfg: TrainConfig, mcfg, width: int) -> None:
  """FlagError when the batch-shaped flags cannot fit in this machine's memory (a floor)."""
  rows = cfg.prompts_per_step * cfg.group_size
  parts = step_bytes(mcfg, rows=rows, seq_len=width + cfg.max_new_tokens,
                     micro_rows=max(1, rows // (cfg.minibatches * cfg.micro_batches)),
                     master_bytes=2 if cfg.master_dtype == "bfloat16" else 4,
                     compute_bytes=4 if cfg.recipe == "fp32" else 2, ref_params=cfg.kl_coef > 0)
  check_step_memory(parts, "--prompts_per_step / --group_size / --max_new_tokens",
                    processes=jax.process_count())


def resume_check(cfg: TrainConfig, directory: str, changes: list):
  """The RL run's resume check: the same flags, and the same learning-rate schedule."""
  describe = f"--schedule={cfg.schedule}, --warmup_steps={cfg.warmup_steps}"
  return resume.resume_check(cfg, directory, changes, schedule=describe,
                             schedule_of=lambda steps: schedule_key(cfg.replace(steps=steps)))


def run(cfg: TrainConfig, *, log=print) -> dict:
  """Run (or resume) an RL experiment; returns a summary dict (also in workdir/summary.json).

  Raises FlagError (a ValueError naming the flag) for anything wrong with the flags or the
  workdir, before compiling; SkippedUpdatesError when the updates of --max_skipped_steps steps
  in a row were all skipped; CheckpointError when the workdir has checkpoints but none intact.
  """
  cfg = cfg.validate()
  parallel.maybe_initialize_distributed(log)  # several processes: before any JAX computation
  make_workdir(cfg.workdir)
  lock = WorkdirLock(cfg.workdir, log) if jax.process_index() == 0 else None
  try:
    return _run(cfg, log)
  finally:
    if lock is not None:
      lock.release()


def _run(cfg: TrainConfig, log) -> dict:
  recipe = get_recipe(cfg.recipe, grad_fmt=cfg.grad_fmt)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  ids = setup.token_ids(tok)
  # Width of prompts seen in training: fixed from a sample of the task's prompts.
  task, width = setup.load_task(cfg.task, difficulty=cfg.difficulty, length=cfg.length,
                                data_path=cfg.data_path, seed=cfg.seed, tok=tok)
  mcfg = setup.model_config(cfg.model, cfg.n_layers, tok, width + cfg.max_new_tokens)
  setup.check_tokenizer(mcfg, tok)
  check_memory(cfg, mcfg, width)
  # Device mesh: the train state in the training layout; the sampler gets the params in the
  # sampling layout (no FSDP) by a device-to-device copy each step when the two differ.
  layout = sample_layout = None
  step_fn = update_step
  if cfg.mesh or jax.device_count() > 1:
    try:
      mesh = parallel.make_mesh(cfg.mesh)
      layout = parallel.make_layout(mesh, mcfg, "train", recipe)
      sample_layout = parallel.make_layout(mesh, mcfg, "sample", recipe)
      layout.rows_sharding(cfg.prompts_per_step * cfg.group_size, strict=True,
                           what="--prompts_per_step x --group_size")
    except ValueError as e:
      raise FlagError("mesh", str(e)) from None
    step_fn = parallel.sharded_update_step(layout)
    log(f"mesh {parallel.mesh_str(mesh)} over {jax.device_count()} devices "
        f"({jax.process_count()} processes)")
  params = setup.make_params(cfg.model, mcfg, cfg.seed)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params, log)
  ucfg = update_config(cfg)
  if layout is not None:
    params = layout.shard_params(params)  # the optimizer state is then built sharded
  state = init_train_state(params, ucfg)
  if layout is not None:
    state = layout.shard_state(state)
  else:  # committed like a restored state, so a resumed run reuses the compiled steps
    state = jax.device_put(state, jax.local_devices()[0])
  del params

  ckpt = Checkpointer(cfg.workdir, cfg.keep_ckpts)
  start, data_pos = 0, 0
  changes = []
  restored = ckpt.restore_latest(_state_tree(state), resume_check(cfg, ckpt.directory, changes),
                                 log)
  if restored is not None:
    tree, meta = restored
    state = TrainState(**tree)
    start, data_pos = int(meta["step"]), int(meta["data_pos"])
    for name in ("metrics.jsonl", "eval.jsonl"):
      MetricWriter(cfg.workdir, name[:-6], tensorboard=False).truncate_after(start)
    record_changes(cfg.workdir, start, changes, log)
    log(f"resumed from {ckpt.directory}/{start} (step {start}, data position {data_pos})")
  else:
    start_fresh(cfg.workdir, ("metrics.jsonl", "eval.jsonl"), RUN_FILES,
                first_checkpoint=min(cfg.ckpt_every, cfg.steps), overwrite=cfg.overwrite,
                log=log, move=jax.process_index() == 0)
  writer = MetricWriter(cfg.workdir, "metrics", cfg.tensorboard)
  eval_writer = MetricWriter(cfg.workdir, "eval", tensorboard=False)
  with open(os.path.join(cfg.workdir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
  log(f"jetrl RL: recipe={cfg.recipe} model={cfg.model} ({mcfg.n_layers} layers, d_model "
      f"{mcfg.d_model}) task={cfg.task} steps={cfg.steps} rows/step="
      f"{cfg.prompts_per_step * cfg.group_size} on {jax.devices()[0].platform}")

  def run_evaluation(step):
    t0 = time.time()
    res = setup.evaluate(state.params, mcfg, task, tok, recipe.rollout, size=cfg.eval_size,
                         max_new_tokens=cfg.max_new_tokens)
    eval_writer.write(step, res)
    log(f"  eval @ step {step}: greedy accuracy {res['eval_accuracy']:.3f} on {cfg.eval_size} "
        f"held-out problems ({time.time() - t0:.1f}s)")
    return res

  if start == 0:
    run_evaluation(0)
  sc = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                      n=cfg.group_size, stop_ids=(ids.eos,), pad_id=ids.pad, prompt_len=width)
  base_key = jax.random.PRNGKey(cfg.seed)
  edges = _bin_edges(cfg.max_new_tokens)
  progress = Progress(cfg.steps, start)
  skips = SkipTracker(cfg.max_skipped_steps, "Check --lr, --temperature, --kl_coef and the "
                      "initial params (--model / --init_from).")
  for step in range(start, cfg.steps):
    k_sample, k_update = jax.random.split(jax.random.fold_in(base_key, step))
    problems = task.batch("train", data_pos, cfg.prompts_per_step)
    data_pos += cfg.prompts_per_step
    prompts = [setup.encode_prompt(tok, p.prompt) for p in problems]

    t_reshard, rollout_params = 0.0, state.params
    if layout is not None:
      rollout_params, t_reshard = parallel.switch_layout(state.params, layout, sample_layout,
                                                         log if step == start else None)
    t0 = time.time()
    out = sample(rollout_params, mcfg, prompts, k_sample, sc, recipe.rollout,
                 layout=sample_layout)
    jax.block_until_ready(out.tokens)
    del rollout_params
    if jax.process_count() > 1:
      out = parallel.to_host(out)  # the host-side reward code needs the global rows
    t_roll = time.time() - t0

    _, rewards = setup.completions_and_rewards(task, tok, problems, out, cfg.group_size)
    shaped = jnp.asarray(rewards)
    if cfg.overlong_buffer:
      shaped = shaped + overlong_penalty(out.lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    adv = group_advantages(shaped, cfg.group_size, normalize_std=ucfg.normalize_std)
    mask = out.mask
    n_dropped = 0
    if cfg.dynamic_sampling:
      keep, n_dropped = dynamic_sampling_mask(shaped, cfg.group_size)
      mask = mask & jnp.repeat(keep, cfg.group_size)[:, None]
    if cfg.mask_truncated:
      mask = truncation_mask(out.stop_reason == STOP_LENGTH, mask)
    batch = make_train_batch(out.prompt_tokens, out.prompt_mask, out.tokens, mask, out.logprobs,
                             adv)
    t_reward = time.time() - t0 - t_roll

    t1 = time.time()
    if layout is not None:
      batch = layout.shard_batch(batch)
    state, m = step_fn(state, batch, k_update, model_config=mcfg, cfg=ucfg,
                       precision=recipe.train, bin_edges=edges)
    jax.block_until_ready(state.params)
    t_update = time.time() - t1

    gen_tokens = int(np.asarray(out.lengths).sum())
    metrics = dict(
        reward_mean=float(shaped.mean()), accuracy=float((rewards >= 1.0).mean()),
        response_length=float(np.asarray(out.lengths).mean()),
        truncated_frac=float((np.asarray(out.stop_reason) == STOP_LENGTH).mean()),
        groups_dropped=float(n_dropped), **{k: v for k, v in m.items()},
        **{"time/rollout": t_roll, "time/reward": t_reward, "time/update": t_update,
           "time/reshard": t_reshard,
           "tokens_per_s/rollout": gen_tokens / max(t_roll, 1e-9),
           "tokens_per_s/update": float(np.asarray(mask).sum()) / max(t_update, 1e-9)})
    metrics["agree/bin_edges"] = list(edges)
    writer.write(step + 1, metrics)
    progress.update(step + 1, {"reward": metrics["reward_mean"], "acc": metrics["accuracy"],
                               "len": metrics["response_length"],
                               "|dlogp|": float(m["agree/abs_diff_mean"])},
                    extra=f"{t_roll:.1f}s rollout {t_update:.1f}s update")
    skips.update(step + 1, int(metrics["skipped_updates"]), ucfg.ppo_epochs * ucfg.minibatches)

    done = step + 1 == cfg.steps
    if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and not done:
      run_evaluation(step + 1)
    if (step + 1) % cfg.ckpt_every == 0 or done:
      ckpt.save(step + 1, _state_tree(state),
                {"step": step + 1, "data_pos": data_pos, "seed": cfg.seed, "kind": "rl",
                 "config": cfg.to_dict()})

  if start < cfg.steps:
    run_evaluation(cfg.steps)
  writer.close()
  ckpt.close()
  evals = read_jsonl(eval_writer.path)
  summary = dict(workdir=cfg.workdir, steps=cfg.steps, recipe=cfg.recipe,
                 eval_before=evals[0]["eval_accuracy"] if evals else None,
                 eval_after=evals[-1]["eval_accuracy"] if evals else None,
                 skipped_updates=int(state.skipped))
  if cfg.plots:
    from jetrl.train.plots import write_plots
    summary["plots"] = write_plots(cfg.workdir)
  with open(os.path.join(cfg.workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary
