"""Supervised warm start on a task's gold solutions, so RL starts from a policy that knows the
answer format. Writes checkpoints that `--init_from` of the RL run reads.

It runs like the RL loop, with the same optimizer (`jetrl.rl.make_optimizer`) and hooks:
checkpoints every `--checkpoint.every` steps (and at the end), and a rerun of the same command
resumes from the newest intact one with the same data order, so a killed SFT run continues
where it stopped and its metric lines are not duplicated. The workdir is locked, earlier
metrics are never deleted, a non-finite update is skipped (and the run stops after
`--max_skipped_steps` such steps in a row), and a change of `--steps` that changes the
learning-rate schedule is refused on resume unless `--allow_schedule_change`
(docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jetrl import parallel
from jetrl.config import FlagError
from jetrl.data.synthetic import misreport
from jetrl.precision import get_recipe
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer, schedule_key
from jetrl.sampling import SamplingConfig, pad_prompts
from jetrl.train import resume, setup
from jetrl.train.checkpoint import Checkpointer
from jetrl.train.config import SFT_RESUMABLE, SFTConfig
from jetrl.train.hooks import (
  CheckpointHook,
  EvalHook,
  LoopState,
  MetricsHook,
  PlotHook,
  SkipHook,
  run_hooks,
)
from jetrl.train.memory import check_eval_memory, check_step_memory, step_bytes
from jetrl.train.resume import CHANGES_FILE, record_changes
from jetrl.train.skips import SkipTracker
from jetrl.train.workdir import start_fresh
from jetrl.train.writers import MetricWriter, Progress, TensorBoard

METRIC_FILES = ("sft_metrics.jsonl", "sft_eval.jsonl")
RUN_FILES = ("sft_summary.json", "sft_config.json", CHANGES_FILE, "tb", "plots")


def _solution_batch(tok, problems, width: int, t_max: int, encode=None):
  """The train batch of gold solutions after their prompts (`encode(text)`, default plain)."""
  encode = encode or (lambda text: setup.encode_prompt(tok, text))
  prompts = [encode(p.prompt) for p in problems]
  sols = [setup.encode_completion(tok, p.solution) for p in problems]
  too_long = [len(s) for s in sols if len(s) > t_max]
  if too_long:
    raise FlagError(
      "max_new_tokens",
      f"a gold solution has {max(too_long)} tokens, more than "
      f"the budget {t_max}; raise --max_new_tokens",
    )
  ids = setup.token_ids(tok)
  ptok, pmask = pad_prompts(
    prompts,
    SamplingConfig(max_new_tokens=t_max, prompt_len=width, pad_id=ids.pad),
    1 << 30,
    1 << 30,
  )
  stok = np.full((len(sols), t_max), ids.pad, np.int32)
  smask = np.zeros((len(sols), t_max), bool)
  for i, s in enumerate(sols):
    stok[i, : len(s)] = s
    smask[i, : len(s)] = True
  zeros = np.zeros((len(sols), t_max), np.float32)
  return make_train_batch(ptok, pmask, stok, smask, zeros, np.zeros(len(sols), np.float32))


def mixed_tasks(cfg: SFTConfig, task, width: int, tok, encode):
  """(the tasks that the steps take problems from in turn, the prompt width they need): the
  task itself, or one per `cfg.mix_lengths`. Each one's first batch is built once here, so a
  gold solution longer than --max_new_tokens is an error before the first step."""
  if not cfg.mix_lengths:
    return [task], width
  tasks = []
  for length in cfg.mix_lengths:
    t, w = setup.load_task(
      dataclasses.replace(cfg.task, length=int(length)), seed=cfg.seed, tok=tok, encode=encode
    )
    tasks.append(t)
    width = max(width, w)
  for t in tasks:
    try:
      _solution_batch(tok, t.batch("train", 0, cfg.batch_size), width, cfg.max_new_tokens, encode)
    except FlagError as e:
      raise FlagError("max_new_tokens", f"at --mix_lengths {t.length}: {e.detail}") from None
  return tasks, width


def misreported(problems, task, cfg: SFTConfig, first_index: int) -> list:
  """`problems` with the final answer of each gold solution misreported with probability
  `cfg.answer_noise` (`jetrl.data.synthetic.misreport`), drawn per training index and seed, so
  a resumed run sees the same targets."""
  out = []
  for i, p in enumerate(problems):
    u = random.Random(f"answer_noise|{cfg.seed}|{first_index + i}").random()
    out.append(misreport(p, task.answer_chars) if u < cfg.answer_noise else p)
  return out


def _sft_step(
  params, opt_state, batch, *, model_config, precision, optimizer: OptimizerConfig, total_steps: int
):
  """One optimizer step on the mean token log-likelihood of the gold solutions.

  Returns (params, opt_state, loss, grad norm, ok, learning rate); a step whose loss,
  gradients or result is not finite is skipped (params and optimizer state unchanged, `ok`
  False)."""

  def loss_fn(p):
    logp, _ = policy_logprobs(p, model_config, batch, precision)
    return -(logp * batch.mask).sum() / jnp.maximum(batch.mask.sum(), 1.0)

  opt = make_optimizer(optimizer, total_steps)
  lr = learning_rate_schedule(optimizer, total_steps)(opt_state.applied)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, new_opt = opt.update(grads, opt_state, params, value=loss)
  ok = new_opt.last_ok
  new_params = jax.tree_util.tree_map(
    lambda a, b: jnp.where(ok, a, b), optax.apply_updates(params, updates), params
  )
  return new_params, new_opt, loss, optax.tree.norm(grads), ok, lr


_STATIC = ("model_config", "precision", "optimizer", "total_steps")
sft_step = jax.jit(_sft_step, static_argnames=_STATIC, donate_argnames=("params", "opt_state"))


def sharded_sft_step(layout, opt_state):
  """`sft_step` on `layout`'s mesh: params and optimizer state come back in the shardings they
  are placed with (`layout.shard_params`, `layout.shard_state`), the scalars replicated."""
  rep = layout.replicated
  return jax.jit(
    _sft_step,
    static_argnames=_STATIC,
    donate_argnames=("params", "opt_state"),
    out_shardings=(layout.param_shardings, layout.tree_shardings(opt_state), rep, rep, rep, rep),
  )


def run_sft(cfg: SFTConfig, *, task=None, log=print) -> dict:
  """Run (or resume) a supervised warm start; returns the greedy evaluation at the end (also in
  workdir/sft_summary.json). `task`: a `jetrl.data.Task` object instead of the one `cfg.task`
  names. Errors as for `jetrl.train.run`."""
  return setup.run_guarded(cfg, task, log, _run_sft)


def resume_check(cfg: SFTConfig, directory: str, changes: list):
  o = cfg.optimizer
  return resume.resume_check(
    cfg,
    directory,
    changes,
    resumable=SFT_RESUMABLE,
    kind="sft",
    schedule=f"--optimizer.schedule={o.schedule}, --optimizer.warmup_steps={o.warmup_steps}",
    schedule_of=lambda steps: schedule_key(o, steps),
  )


def _run_sft(cfg: SFTConfig, log, given=None, reward=None) -> dict:
  recipe = get_recipe(cfg.recipe)
  tok = setup.make_tokenizer(cfg.model, cfg.task)
  encode = setup.prompt_encoder(cfg.task, tok)
  task, width = setup.load_task(
    cfg.task, seed=cfg.seed, tok=tok, encode=encode, given=given, reward=reward
  )
  train_tasks, width = mixed_tasks(cfg, task, width, tok, encode)
  mcfg = setup.model_config(cfg.model, tok, width + cfg.max_new_tokens)
  setup.check_tokenizer(mcfg, tok)
  check_step_memory(
    step_bytes(
      mcfg,
      rows=min(cfg.eval.size, 64),
      seq_len=width + cfg.max_new_tokens,
      micro_rows=cfg.batch_size,
      compute_bytes=4 if cfg.recipe == "fp32" else 2,
    ),
    "--batch_size / --max_new_tokens",
    processes=jax.process_count(),
  )
  check_eval_memory(
    mcfg,
    cfg.eval.rows,
    cfg.max_new_tokens,
    "--eval.batch / --eval.samples / --max_new_tokens",
    resident=mcfg.n_params * (4 + 8),
    compute_bytes=4 if cfg.recipe == "fp32" else 2,
    value_exponents=recipe.rollout.batch_invariant,
  )
  layout, sample_layout = setup.layouts(
    cfg.mesh,
    mcfg,
    recipe,
    {"--batch_size": cfg.batch_size},
    log,
  )
  params = setup.make_params(cfg.model, mcfg, cfg.seed)
  step_fn = sft_step
  if layout is not None:
    params = layout.shard_params(params)  # the optimizer state is then built sharded
    opt_state = layout.shard_state(make_optimizer(cfg.optimizer, cfg.steps).init(params))
    step_fn = sharded_sft_step(layout, opt_state)
  else:
    opt_state = make_optimizer(cfg.optimizer, cfg.steps).init(params)
    # Committed like a restored state, so a resumed run reuses the compiled step.
    params, opt_state = jax.device_put((params, opt_state), jax.local_devices()[0])
  ckpt = Checkpointer(cfg.workdir, cfg.checkpoint.keep)
  primary = parallel.is_primary()  # writes the run's files; every process runs every step
  start, changes = 0, []
  restored = ckpt.restore_latest(
    {"params": params, "opt_state": opt_state}, resume_check(cfg, ckpt.directory, changes), log
  )
  if restored is not None:
    state, meta = restored
    params, opt_state, start = state["params"], state["opt_state"], int(meta["step"])
    for name in METRIC_FILES:
      MetricWriter(cfg.workdir, name[: -len(".jsonl")], enabled=primary).truncate_after(start)
    record_changes(cfg.workdir, start, changes, log)
    log(f"resumed SFT at step {start}")
  else:
    parallel.on_primary(
      lambda: start_fresh(
        cfg.workdir,
        METRIC_FILES,
        RUN_FILES,
        first_checkpoint=min(cfg.checkpoint.every, cfg.steps),
        overwrite=cfg.overwrite,
        log=log,
        config_file="sft_config.json",
      )
    )
  if primary:
    with open(os.path.join(cfg.workdir, "sft_config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=1)
  tb = TensorBoard(cfg.workdir) if cfg.logging.tensorboard and primary else None
  log(
    f"jetrl SFT: task={cfg.task.name} ({cfg.task.prompt_format} prompts) model="
    f"{cfg.model.name} ({mcfg.n_layers} layers) "
    f"steps={cfg.steps} batch={cfg.batch_size} recipe={cfg.recipe}"
  )

  def evaluate(loop):
    params = loop.state["params"]
    if layout is not None:
      params, _ = parallel.switch_layout(params, layout, sample_layout)
    return setup.evaluate(
      params,
      mcfg,
      task,
      tok,
      recipe.rollout,
      size=cfg.eval.size,
      max_new_tokens=cfg.max_new_tokens,
      batch=cfg.eval.batch,
      encode=encode,
      layout=sample_layout,
      temperature=cfg.eval.temperature,
      samples=cfg.eval.samples,
    )

  from jetrl.train.plots import write_sft_plots  # pylint: disable=import-outside-toplevel

  eval_hook = EvalHook(
    evaluate,
    MetricWriter(
      cfg.workdir,
      "sft_eval",
      tb,
      tag=lambda k: "eval/" + k.removeprefix("eval_"),
      enabled=primary,
    ),
    cfg.eval.every,
    cfg.eval.size,
    log,
    cfg.eval.label,
  )
  plot_hook = PlotHook(lambda: write_sft_plots(cfg.workdir), cfg.logging.plot_every)
  hooks = [
    MetricsHook(
      MetricWriter(cfg.workdir, "sft_metrics", tb, enabled=primary),
      Progress(cfg.steps, start, write=log if primary else lambda _line: None),
      cfg.logging.every,
      lambda r: ({"loss": float(r["loss"])}, None),
    ),
    SkipHook(
      SkipTracker(
        cfg.max_skipped_steps, "Check --optimizer.lr and the initial params (--model.name)."
      ),
      1,
    ),
    eval_hook,
    CheckpointHook(
      ckpt,
      cfg.checkpoint.every,
      lambda loop: loop.state,
      lambda step, loop: {"step": step, "kind": "sft", "config": cfg.to_dict()},
    ),
  ] + ([plot_hook] if cfg.logging.plots and primary else [])
  loop = LoopState(state={"params": params, "opt_state": opt_state})
  skipped = int(opt_state.skipped)
  try:
    for step in range(start, cfg.steps):
      problems = train_tasks[step % len(train_tasks)].batch(
        "train", step * cfg.batch_size, cfg.batch_size
      )
      if cfg.answer_noise:
        problems = misreported(problems, task, cfg, step * cfg.batch_size)
      batch = _solution_batch(tok, problems, width, cfg.max_new_tokens, encode)
      if layout is not None:  # every process builds the same batch and places its rows
        batch = layout.shard_batch(batch)
      params, opt_state, loss, gnorm, ok, lr = step_fn(
        loop.state["params"],
        loop.state["opt_state"],
        batch,
        model_config=mcfg,
        precision=recipe.train,
        optimizer=cfg.optimizer,
        total_steps=cfg.steps,
      )
      loop.state = {"params": params, "opt_state": opt_state}
      loop.skipped = 0 if bool(ok) else 1
      skipped += loop.skipped
      loop.record = {
        "loss": loss,
        "grad_norm": gnorm,
        "skipped_updates": skipped,
        "learning_rate": lr,
      }
      run_hooks(hooks, step + 1, step + 1 == cfg.steps, loop)
  finally:
    for hook in hooks:
      hook.close()
    if tb is not None:
      tb.close()

  res = eval_hook.last if eval_hook.last is not None else evaluate(loop)
  log(f"SFT done: {cfg.eval.label} {res['eval_accuracy']:.3f} on {cfg.eval.size} held-out problems")
  summary = dict(workdir=cfg.workdir, **res)
  if plot_hook.paths:
    summary["plots"] = plot_hook.paths
  if primary:
    with open(os.path.join(cfg.workdir, "sft_summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return summary
