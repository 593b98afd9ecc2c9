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

With several processes (`python -m jetrl.launch`, a cluster) every process runs every step on
one mesh over all their devices; each scores the rows it holds and the rewards are gathered,
and process 0 alone writes the run's files (docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax

from jetrl import parallel
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
  SamplesHook,
  SkipHook,
  run_hooks,
)
from jetrl.train.memory import check_eval_memory, check_step_memory, step_bytes
from jetrl.train.resume import CHANGES_FILE, record_changes
from jetrl.train.rl_step import RLStep, console_fields
from jetrl.train.skips import SkipTracker
from jetrl.train.workdir import start_fresh
from jetrl.train.writers import MetricWriter, Progress, TensorBoard

METRIC_FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")
RUN_FILES = ("summary.json", "config.json", CHANGES_FILE, "tb", "plots")


def _silent(_line: str) -> None:
  pass


def _state_tree(state: TrainState) -> dict:
  return {k: v for k, v in state._asdict().items() if v is not None}


def _bin_edges(max_new_tokens: int) -> tuple[int, ...]:
  return tuple(e for e in DEFAULT_EDGES if e < max_new_tokens) or (0,)


def check_memory(cfg: TrainConfig, mcfg, width: int) -> None:
  """FlagError when the batch-shaped flags (a step's, an evaluation call's) cannot fit in this
  machine's memory (a floor)."""
  u = cfg.update
  master_bytes = 2 if u.master_dtype == "bfloat16" else 4
  compute_bytes = 4 if cfg.recipe == "fp32" else 2
  value_exponents = get_recipe(cfg.recipe).rollout.batch_invariant
  parts = step_bytes(
    mcfg,
    rows=cfg.rows,
    seq_len=width + cfg.sampling.max_new_tokens,
    micro_rows=max(1, cfg.rows // (u.minibatches * u.micro_batches)),
    master_bytes=master_bytes,
    compute_bytes=compute_bytes,
    ref_params=u.kl_coef > 0,
    value_exponents=value_exponents,
  )
  check_step_memory(
    parts,
    "--prompts_per_step / --sampling.n / --sampling.max_new_tokens",
    processes=jax.process_count(),
  )
  check_eval_memory(
    mcfg,
    cfg.eval.rows,
    cfg.sampling.max_new_tokens,
    "--eval.batch / --eval.samples / --sampling.max_new_tokens",
    resident=mcfg.n_params * (master_bytes * (2 if u.kl_coef > 0 else 1) + 8),
    compute_bytes=compute_bytes,
    value_exponents=value_exponents,
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


def run(cfg: TrainConfig, *, task=None, log=print) -> dict:
  """Run (or resume) an RL experiment; returns a summary dict (also in workdir/summary.json).

  task: a `jetrl.data.Task` object to train on instead of the one `cfg.task` names (its
    prompt format and reward still apply); its name is recorded as `task.name`.

  Raises FlagError (a ValueError naming the flag) for anything wrong with the flags or the
  workdir, before compiling; SkippedUpdatesError when the updates of --max_skipped_steps steps
  in a row were all skipped; CheckpointError when the workdir has checkpoints but none intact.
  """
  return setup.run_guarded(cfg, task, log, _run)


def _devices(cfg: TrainConfig, mcfg, recipe, log):
  """(training layout, sampling layout, update step): Nones and the one-device step when
  there is one device and no --mesh. The train state lives in the training layout; the
  sampler gets the params in the sampling layout (no FSDP) by a device-to-device copy each
  step when the two differ."""
  layout, sample_layout = setup.layouts(
    cfg.mesh, mcfg, recipe, {"--prompts_per_step x --sampling.n": cfg.rows}, log
  )
  if layout is None:
    return None, None, update_step
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
    parallel.on_primary(
      lambda: start_fresh(
        cfg.workdir,
        METRIC_FILES,
        RUN_FILES,
        first_checkpoint=min(cfg.checkpoint.every, cfg.steps),
        overwrite=cfg.overwrite,
        log=log,
        config_file="config.json",
      )
    )
    return state, 0, 0
  tree, meta = restored
  start, data_pos = int(meta["step"]), int(meta["data_pos"])
  for name in METRIC_FILES:
    writer = MetricWriter(cfg.workdir, name[: -len(".jsonl")], enabled=parallel.is_primary())
    writer.truncate_after(start)
  record_changes(cfg.workdir, start, changes, log)
  log(f"resumed from {ckpt.directory}/{start} (step {start}, data position {data_pos})")
  return TrainState(**tree), start, data_pos


def _run(cfg: TrainConfig, log, given=None, reward=None) -> dict:
  recipe = get_recipe(cfg.recipe, grad_fmt=cfg.grad_fmt)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  ids = setup.token_ids(tok)
  encode = setup.prompt_encoder(cfg.task, tok)
  # Width of prompts seen in training: fixed from a sample of the task's prompts.
  task, width = setup.load_task(
    cfg.task, seed=cfg.seed, tok=tok, encode=encode, given=given, reward=reward
  )
  mcfg = setup.model_config(cfg.model, tok, width + cfg.sampling.max_new_tokens)
  setup.check_tokenizer(mcfg, tok)
  check_memory(cfg, mcfg, width)
  layout, sample_layout, update_fn = _devices(cfg, mcfg, recipe, log)
  ckpt = Checkpointer(cfg.workdir, cfg.checkpoint.keep)
  state, start, data_pos = _restore(cfg, ckpt, _initial_state(cfg, mcfg, layout, log), log)

  primary = parallel.is_primary()  # writes the run's files; every process runs every step
  tb = TensorBoard(cfg.workdir) if cfg.logging.tensorboard and primary else None
  writer = MetricWriter(cfg.workdir, "metrics", tb, enabled=primary)
  eval_writer = MetricWriter(
    cfg.workdir, "eval", tb, tag=lambda k: "eval/" + k.removeprefix("eval_"), enabled=primary
  )
  samples_writer = MetricWriter(cfg.workdir, "samples", enabled=primary)
  if primary:
    with open(os.path.join(cfg.workdir, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=1)
  log(
    f"jetrl RL: recipe={cfg.recipe} model={cfg.model.name} ({mcfg.n_layers} layers, d_model "
    f"{mcfg.d_model}) task={cfg.task.name} ({cfg.task.prompt_format} prompts"
    f"{', reward ' + cfg.task.reward if cfg.task.reward else ''}) steps={cfg.steps} "
    f"rows/step={cfg.rows} stop ids={list(ids.stop)} on {jax.devices()[0].platform}"
  )

  step = RLStep(
    cfg=cfg,
    task=task,
    tok=tok,
    encode=encode,
    model_config=mcfg,
    recipe=recipe,
    sampling=dataclasses.replace(cfg.sampling, stop_ids=ids.stop, pad_id=ids.pad, prompt_len=width),
    update_fn=update_fn,
    bin_edges=_bin_edges(cfg.sampling.max_new_tokens),
    layout=layout,
    sample_layout=sample_layout,
  )

  def evaluate(loop):
    params = loop.state.params
    if layout is not None:
      params, _ = parallel.switch_layout(params, layout, sample_layout)
    score = functools.partial(
      setup.evaluate,
      params,
      mcfg,
      task,
      tok,
      size=cfg.eval.size,
      max_new_tokens=cfg.sampling.max_new_tokens,
      batch=cfg.eval.batch,
      encode=encode,
      layout=sample_layout,
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
    MetricsHook(
      writer,
      Progress(cfg.steps, start, write=log if primary else _silent),
      cfg.logging.every,
      console_fields,
    ),
    SamplesHook(samples_writer),
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
  ] + ([plot_hook] if cfg.logging.plots and primary else [])
  loop = LoopState(state=state, data_pos=data_pos)
  if start == 0:
    eval_hook(0, loop)
  try:
    for i in range(start, cfg.steps):
      loop.state, loop.record, loop.data_pos, loop.samples = step(
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

  parallel.barrier("jetrl:run-end")  # the primary's last records are written
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
  if primary:
    with open(os.path.join(cfg.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return summary
