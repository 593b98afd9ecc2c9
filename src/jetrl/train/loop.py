"""The RL loop: `run(TrainConfig)` is what `experiments/train.py` calls; it is importable from
notebooks.

A run builds its pieces (tokenizer, task, model, train state, device mesh), restores the newest
intact checkpoint in its workdir if there is one, then runs `jetrl.train.rl_step.RLStep` once
per step and its hooks after each (`jetrl.train.hooks`): the step's metric record and console
line, the skipped-updates stop, greedy evaluation every `--eval.every` steps, a checkpoint
every `--checkpoint.every` steps, plots. Rerunning the same config on the same workdir resumes;
PRNG keys are derived from (seed, step), so a resumed run reproduces an uninterrupted one.

Before anything compiles, the flags, the tokenizer against the model, the memory a step needs
and the device mesh are checked (a FlagError names the flag); the workdir is locked for the
run, and earlier metrics in it are never deleted. A run whose updates are all skipped for
`--max_skipped_steps` steps in a row stops with an error (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax

from jetrl import parallel
from jetrl.config import FlagError
from jetrl.precision import get_recipe
from jetrl.rl import DEFAULT_EDGES, init_train_state, update_step
from jetrl.rl.optimizer import schedule_key
from jetrl.rl.update import TrainState
from jetrl.train import resume, setup
from jetrl.train.checkpoint import Checkpointer, load_params_from
from jetrl.train.config import RESUMABLE, TrainConfig
from jetrl.train.hooks import (
  CheckpointHook,
  EvalHook,
  LoopState,
  MetricsHook,
  PlotHook,
  SkipHook,
  run_hooks,
)
from jetrl.train.memory import check_step_memory, step_bytes
from jetrl.train.resume import CHANGES_FILE, record_changes
from jetrl.train.rl_step import RLStep, console_fields
from jetrl.train.skips import SkipTracker
from jetrl.train.workdir import WorkdirLock, make_workdir, start_fresh
from jetrl.train.writers import MetricWriter, Progress, TensorBoard

METRIC_FILES = ("metrics.jsonl", "eval.jsonl")
RUN_FILES = ("summary.json", "config.json", CHANGES_FILE, "tb", "plots")


def _state_tree(state: TrainState) -> dict:
  return {k: v for k, v in state._asdict().items() if v is not None}


def _bin_edges(max_new_tokens: int) -> tuple[int, ...]:
  return tuple(e for e in DEFAULT_EDGES if e < max_new_tokens) or (0,)


def check_memory(cfg: TrainConfig, mcfg, width: int) -> None:
  """FlagError when the batch-shaped flags cannot fit in this machine's memory (a floor)."""
  u = cfg.update
  parts = step_bytes(
    mcfg,
    rows=cfg.rows,
    seq_len=width + cfg.sampling.max_new_tokens,
    micro_rows=max(1, cfg.rows // (u.minibatches * u.micro_batches)),
    master_bytes=2 if u.master_dtype == "bfloat16" else 4,
    compute_bytes=4 if cfg.recipe == "fp32" else 2,
    ref_params=u.kl_coef > 0,
  )
  check_step_memory(
    parts,
    "--prompts_per_step / --sampling.n / --sampling.max_new_tokens",
    processes=jax.process_count(),
  )


def resume_check(cfg: TrainConfig, directory: str, changes: list):
  """The RL run's resume check: an RL checkpoint, the same flags, the same schedule."""
  o = cfg.optimizer
  describe = f"--optimizer.schedule={o.schedule}, --optimizer.warmup_steps={o.warmup_steps}"
  return resume.resume_check(
    cfg,
    directory,
    changes,
    schedule=describe,
    resumable=RESUMABLE,
    kind="rl",
    schedule_of=lambda steps: schedule_key(o, cfg.update.optimizer_steps(steps)),
  )


def run(cfg: TrainConfig, *, log=print) -> dict:
  """Run (or resume) an RL experiment; returns a summary dict (also in workdir/summary.json).

  Raises FlagError (a ValueError naming the flag) for anything wrong with the flags or the
  workdir, before compiling; SkippedUpdatesError when the updates of --max_skipped_steps steps
  in a row were all skipped; CheckpointError when the workdir has checkpoints but none intact.
  """
  cfg.check_paths()
  parallel.maybe_initialize_distributed(log)  # several processes: before any JAX computation
  make_workdir(cfg.workdir)
  lock = WorkdirLock(cfg.workdir, log) if jax.process_index() == 0 else None
  try:
    return _run(cfg, log)
  finally:
    if lock is not None:
      lock.release()


def _devices(cfg: TrainConfig, mcfg, recipe, log):
  """(training layout, sampling layout, update step): Nones and the one-device step when
  there is one device and no --mesh. The train state lives in the training layout; the
  sampler gets the params in the sampling layout (no FSDP) by a device-to-device copy each
  step when the two differ."""
  if not cfg.mesh and jax.device_count() == 1:
    return None, None, update_step
  try:
    mesh = parallel.make_mesh(cfg.mesh or "")
    layout = parallel.make_layout(mesh, mcfg, "train", recipe)
    sample_layout = parallel.make_layout(mesh, mcfg, "sample", recipe)
    layout.rows_sharding(cfg.rows, strict=True, what="--prompts_per_step x --sampling.n")
  except ValueError as e:
    raise FlagError("mesh", str(e)) from None
  log(
    f"mesh {parallel.mesh_str(mesh)} over {jax.device_count()} devices "
    f"({jax.process_count()} processes)"
  )
  return layout, sample_layout, parallel.sharded_update_step(layout)


def _initial_state(cfg: TrainConfig, mcfg, layout, log) -> TrainState:
  params = setup.make_params(cfg.model, mcfg, cfg.seed)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params, log)
  if layout is not None:
    params = layout.shard_params(params)  # the optimizer state is then built sharded
  state = init_train_state(params, cfg.update, cfg.optimizer)
  if layout is not None:
    return layout.shard_state(state)
  # Committed like a restored state, so a resumed run reuses the compiled steps.
  return jax.device_put(state, jax.local_devices()[0])


def _restore(cfg: TrainConfig, ckpt: Checkpointer, state: TrainState, log):
  """(state, first step, data position): from the newest intact checkpoint, or a fresh start
  (earlier files moved aside, never deleted)."""
  changes = []
  restored = ckpt.restore_latest(
    _state_tree(state), resume_check(cfg, ckpt.directory, changes), log
  )
  if restored is None:
    start_fresh(
      cfg.workdir,
      METRIC_FILES,
      RUN_FILES,
      first_checkpoint=min(cfg.checkpoint.every, cfg.steps),
      overwrite=cfg.overwrite,
      log=log,
      move=jax.process_index() == 0,
    )
    return state, 0, 0
  tree, meta = restored
  start, data_pos = int(meta["step"]), int(meta["data_pos"])
  for name in METRIC_FILES:
    MetricWriter(cfg.workdir, name[: -len(".jsonl")]).truncate_after(start)
  record_changes(cfg.workdir, start, changes, log)
  log(f"resumed from {ckpt.directory}/{start} (step {start}, data position {data_pos})")
  return TrainState(**tree), start, data_pos


def _run(cfg: TrainConfig, log) -> dict:
  recipe = get_recipe(cfg.recipe, grad_fmt=cfg.grad_fmt)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  ids = setup.token_ids(tok)
  # Width of prompts seen in training: fixed from a sample of the task's prompts.
  task, width = setup.load_task(cfg.task, seed=cfg.seed, tok=tok)
  mcfg = setup.model_config(cfg.model, tok, width + cfg.sampling.max_new_tokens)
  setup.check_tokenizer(mcfg, tok)
  check_memory(cfg, mcfg, width)
  layout, sample_layout, update_fn = _devices(cfg, mcfg, recipe, log)
  ckpt = Checkpointer(cfg.workdir, cfg.checkpoint.keep)
  state, start, data_pos = _restore(cfg, ckpt, _initial_state(cfg, mcfg, layout, log), log)

  tb = TensorBoard(cfg.workdir) if cfg.logging.tensorboard else None
  writer = MetricWriter(cfg.workdir, "metrics", tb)
  eval_writer = MetricWriter(
    cfg.workdir, "eval", tb, tag=lambda k: "eval/" + k.removeprefix("eval_")
  )
  if jax.process_index() == 0:
    with open(os.path.join(cfg.workdir, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=1)
  log(
    f"jetrl RL: recipe={cfg.recipe} model={cfg.model.name} ({mcfg.n_layers} layers, d_model "
    f"{mcfg.d_model}) task={cfg.task.name} steps={cfg.steps} rows/step={cfg.rows} on "
    f"{jax.devices()[0].platform}"
  )

  step = RLStep(
    cfg=cfg,
    task=task,
    tok=tok,
    model_config=mcfg,
    recipe=recipe,
    sampling=dataclasses.replace(cfg.sampling, stop_ids=ids.stop, pad_id=ids.pad, prompt_len=width),
    update_fn=update_fn,
    bin_edges=_bin_edges(cfg.sampling.max_new_tokens),
    layout=layout,
    sample_layout=sample_layout,
  )

  def evaluate(loop):
    score = functools.partial(
      setup.evaluate,
      loop.state.params,
      mcfg,
      task,
      tok,
      size=cfg.eval.size,
      max_new_tokens=cfg.sampling.max_new_tokens,
      batch=cfg.eval.batch,
      temperature=cfg.eval.temperature,
      samples=cfg.eval.samples,
    )
    res = score(recipe.rollout)
    if cfg.eval.also_bf16:  # the same params scored with the bf16 rollout
      ref = res if cfg.recipe == "bf16" else score(get_recipe("bf16").rollout)
      res.update({f"{k}_bf16": v for k, v in ref.items()})
    return res

  def meta(step_no, loop):
    return {
      "step": step_no,
      "data_pos": loop.data_pos,
      "seed": cfg.seed,
      "kind": "rl",
      "config": cfg.to_dict(),
    }

  from jetrl.train.plots import write_plots  # pylint: disable=import-outside-toplevel

  eval_hook = EvalHook(evaluate, eval_writer, cfg.eval.every, cfg.eval.size, log, cfg.eval.label)
  plot_hook = PlotHook(lambda: write_plots(cfg.workdir), cfg.logging.plot_every)
  hooks = [
    MetricsHook(writer, Progress(cfg.steps, start, write=log), cfg.logging.every, console_fields),
    SkipHook(
      SkipTracker(
        cfg.max_skipped_steps,
        "Check --optimizer.lr, "
        "--sampling.temperature, --update.kl_coef and the initial params "
        "(--model.name / --init_from).",
      ),
      cfg.update.ppo_epochs * cfg.update.minibatches,
    ),
    eval_hook,
    CheckpointHook(ckpt, cfg.checkpoint.every, lambda loop: _state_tree(loop.state), meta),
  ] + ([plot_hook] if cfg.logging.plots else [])
  loop = LoopState(state=state, data_pos=data_pos)
  if start == 0:
    eval_hook(0, loop)
  try:
    for i in range(start, cfg.steps):
      loop.state, loop.record, loop.data_pos = step(
        loop.state, i, loop.data_pos, log if i == start else None
      )
      loop.record["time/compiled"] = float(i == start)  # the process's first step compiles
      loop.skipped = int(loop.record["skipped_updates"])
      run_hooks(hooks, i + 1, i + 1 == cfg.steps, loop)
  finally:
    for hook in hooks:
      hook.close()
    if tb is not None:
      tb.close()

  evals = eval_writer.records()
  summary = dict(
    workdir=cfg.workdir,
    steps=cfg.steps,
    recipe=cfg.recipe,
    eval_before=evals[0]["eval_accuracy"] if evals else None,
    eval_after=evals[-1]["eval_accuracy"] if evals else None,
    skipped_updates=int(loop.state.skipped),
  )
  if plot_hook.paths:
    summary["plots"] = plot_hook.paths
  if jax.process_index() == 0:
    with open(os.path.join(cfg.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return summary
