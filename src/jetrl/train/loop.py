"""The RL loop: `run(TrainConfig)` is what `experiments/train.py` calls; it is importable from
notebooks.

A run builds its pieces (tokenizer, task, model, train state, device mesh), restores the newest
intact checkpoint in its workdir if there is one, then runs `jetrl.train.rl_step.RLStep` once
per step and its hooks after each (`jetrl.train.hooks`): the step's metric record and console
line, the skipped-updates stop, greedy evaluation every `--eval.every` steps, a checkpoint
every `--checkpoint.every` steps, plots. Rerunning the same config on the same workdir resumes;
PRNG keys are derived from (seed, step), so a resumed run reproduces an uninterrupted one.
What it shares with the supervised warm start is `jetrl.train.driver`.

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
from typing import Sequence

import jax

from jetrl import parallel
from jetrl.precision import get_recipe
from jetrl.config import FlagError
from jetrl.models.lora import attach, init_adapters
from jetrl.rl import DEFAULT_EDGES, init_lora_train_state, init_train_state, update_step
from jetrl.rl.update import TrainState
from jetrl.train import pieces, driver, evaluation
from jetrl.train.checkpoint import Checkpointer, load_params_from
from jetrl.train.config import TrainConfig
from jetrl.train.hooks import Hook, LoopState, SamplesHook
from jetrl.train.learning_signal import SignalHook
from jetrl.train.memory import check_eval_memory, check_step_memory, eval_bytes, step_bytes
from jetrl.train.plots import write_plots
from jetrl.train.rl_step import RLStep, console_fields

# The PRNG stream of a LoRA run's adapter init: fold_in(PRNGKey(seed), LORA_INIT_STREAM).
LORA_INIT_STREAM = 0x10AA

SKIP_HINT = (
  "Check --optimizer.lr, --sampling.temperature, --update.kl_coef and the initial params "
  "(--model.name / --init_from)."
)


def _state_tree(state: TrainState) -> dict:
  """What a checkpoint holds: the state without a LoRA run's frozen base (rebuilt at start)."""
  return {k: v for k, v in state._asdict().items() if v is not None and k != "frozen"}


def policy_params(cfg: TrainConfig, state: TrainState):
  """The params the model reads: the state's, or a LoRA run's adapters on its frozen base."""
  if state.frozen is None:
    return state.params
  return attach(state.frozen, state.params, cfg.lora)


def _bin_edges(max_new_tokens: int) -> tuple[int, ...]:
  return tuple(e for e in DEFAULT_EDGES if e < max_new_tokens) or (0,)


def check_memory(cfg: TrainConfig, mcfg, width: int) -> None:
  """FlagError when the batch-shaped flags (a step's, an evaluation call's) cannot fit in this
  machine's memory (a floor)."""
  u = cfg.update
  recipe = cfg.precision_recipe
  master_bytes = 2 if u.master_dtype == "bfloat16" else 4
  parts = step_bytes(
    mcfg,
    rows=cfg.rows,
    seq_len=width + cfg.sampling.max_new_tokens,
    micro_rows=max(1, cfg.rows // (u.minibatches * u.micro_batches)),
    master_bytes=master_bytes,
    recipe=recipe,
    ref_params=u.kl_coef > 0,
  )
  check_step_memory(
    parts,
    "--prompts_per_step / --sampling.n / --sampling.max_new_tokens",
    processes=jax.process_count(),
  )
  resident = mcfg.n_params * (master_bytes * (2 if u.kl_coef > 0 else 1) + 8)
  check_eval_memory(
    eval_bytes(
      mcfg,
      rows=cfg.eval.rows,
      max_new_tokens=cfg.sampling.max_new_tokens,
      resident=resident,
      recipe=recipe,
    ),
    "--eval.batch / --eval.samples / --sampling.max_new_tokens",
  )


def run(cfg: TrainConfig, *, task=None, log=print, hooks: Sequence[Hook] = ()) -> dict:
  """Run (or resume) an RL experiment; returns a summary dict (also in workdir/summary.json).

  task: a `jetrl.data.Task` object to train on instead of the one `cfg.task` names (its
    prompt format and reward still apply); its name is recorded as `task.name`.
  hooks: `jetrl.train.hooks.Hook`s of your own, run after each step's built-in ones (its
    record, evaluation and checkpoint written) when due; an exception one raises ends the run
    there, and rerunning resumes from the newest checkpoint.

  Raises FlagError (a ValueError naming the flag) for anything wrong with the flags or the
  workdir, before compiling; SkippedUpdatesError when the updates of --max_skipped_steps steps
  in a row were all skipped; CheckpointError when the workdir has checkpoints but none intact.
  """
  user = driver.user_hooks(hooks, "run")
  return driver.run_guarded(cfg, task, log, functools.partial(_run, user=user))


def _pieces(cfg: TrainConfig, log, given, reward) -> pieces.Pieces:
  """The run's pieces, checked (tokenizer against the model, memory, mesh) before anything
  compiles. The train state lives in the training layout; the sampler gets the params in the
  sampling layout (no FSDP) by a device-to-device copy each step when the two differ."""
  recipe = cfg.precision_recipe
  tok, encode, task, width = driver.tokenizer_and_task(cfg, given, reward)
  mcfg = pieces.model_config(cfg.model, tok, width + cfg.sampling.max_new_tokens)
  if cfg.lora.enabled and mcfg.moe:
    raise FlagError(
      "lora.rank",
      f"LoRA adapts the dense projections and {cfg.model.name} is a mixture of experts "
      f"({mcfg.n_experts} experts a layer); set --lora.rank=0 for full fine-tuning",
    )
  check_memory(cfg, mcfg, width)
  layout, sample_layout = pieces.layouts(
    cfg.mesh, mcfg, recipe, {"--prompts_per_step x --sampling.n": cfg.rows}, log
  )
  if cfg.lora.enabled and layout is not None:
    raise FlagError(
      "lora.rank",
      f"LoRA runs on one device; this run has {jax.device_count()} devices"
      + (f" and --mesh={cfg.mesh}" if cfg.mesh else "")
      + " (set --lora.rank=0 for full fine-tuning on a mesh, or run on one device)",
    )
  return pieces.Pieces(recipe, tok, encode, task, width, mcfg, layout, sample_layout, cfg.kernels)


def _initial_state(cfg: TrainConfig, p: pieces.Pieces, log) -> TrainState:
  params = pieces.make_params(cfg.model, p.mcfg, cfg.seed)
  if cfg.init_from:
    params = load_params_from(cfg.init_from, params, log)
  if cfg.lora.enabled:
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), LORA_INIT_STREAM)
    adapters = init_adapters(p.mcfg, cfg.lora, key)
    state = init_lora_train_state(
      params, adapters, cfg.lora, p.recipe.train, cfg.update, cfg.optimizer, p.kernels
    )
    return jax.device_put(state, jax.local_devices()[0])
  if p.layout is not None:
    params = p.layout.shard_params(params)  # the optimizer state is then built sharded
  state = init_train_state(params, cfg.update, cfg.optimizer)
  if p.layout is not None:
    return p.layout.shard_state(state)
  # Committed like a restored state, so a resumed run reuses the compiled steps.
  return jax.device_put(state, jax.local_devices()[0])


def _restore(cfg: TrainConfig, ckpt: Checkpointer, state: TrainState, log):
  """(state, first step, data position): from the newest intact checkpoint, or a fresh start
  (earlier files moved aside, never deleted)."""
  tree, meta = driver.restore_or_start(cfg, driver.RL, ckpt, _state_tree(state), log)
  if meta is None:
    return state, 0, 0
  start, data_pos = int(meta["step"]), int(meta["data_pos"])
  log(f"resumed from {ckpt.restored} (step {start}, data position {data_pos})")
  return TrainState(**tree, frozen=state.frozen), start, data_pos


def _rl_step(cfg: TrainConfig, p: pieces.Pieces) -> RLStep:
  ids = pieces.token_ids(p.tok)
  return RLStep(
    cfg=cfg,
    pieces=p,
    sampling=dataclasses.replace(
      cfg.sampling, stop_ids=ids.stop, pad_id=ids.pad, prompt_len=p.width
    ),
    update_fn=update_step if p.layout is None else parallel.sharded_update_step(p.layout),
    bin_edges=_bin_edges(cfg.sampling.max_new_tokens),
  )


def _step(rl_step: RLStep, start: int, log, i: int, loop: LoopState) -> None:
  """Step i + 1: rollout, rewards, update; the first step this process runs logs its stages."""
  loop.state, loop.record, loop.data_pos, loop.samples = rl_step(
    loop.state, i, loop.data_pos, log if i == start else None
  )
  loop.record["time/compiled"] = float(i == start)  # the process's first step compiles
  loop.skipped = int(loop.record["skipped_updates"])


def _evaluate(cfg: TrainConfig, p: pieces.Pieces, loop: LoopState, log=None) -> dict:
  """Evaluation in the recipe's rollout precision (and, with --eval.also_bf16, the same
  params in the bf16 rollout's, as `*_bf16`); `log` gets its progress."""
  params = p.rollout_params(policy_params(cfg, loop.state))

  score = lambda precision, log: evaluation.evaluate(
    params, p, precision, cfg.eval, max_new_tokens=cfg.sampling.max_new_tokens, log=log
  )
  res = score(p.recipe.rollout, log)
  if cfg.eval.also_bf16:
    bf16 = get_recipe("bf16").rollout  # the common scale every recipe is also scored on
    bf16_log = None if log is None else (lambda line: log(f"{line} (bf16 rollout)"))
    ref = res if p.recipe.rollout == bf16 else score(bf16, bf16_log)
    res.update({f"{k}_bf16": v for k, v in ref.items()})
  return res


def _hooks(
  cfg: TrainConfig, p, out: driver.Outputs, ckpt, start: int, log, user=()
) -> driver.Hooks:
  spec = driver.HookSpec(
    evaluate=functools.partial(_evaluate, cfg, p, log=log),
    console=console_fields,
    skip_hint=SKIP_HINT,
    updates_per_step=cfg.update.ppo_epochs * cfg.update.minibatches,
    tree=lambda loop: _state_tree(loop.state),
    meta=lambda loop: {"data_pos": loop.data_pos, "seed": cfg.seed},
    draw=lambda workdir: write_plots(workdir, eval_label=cfg.eval.label),
    extra=(
      SamplesHook(out.writer("samples", tensorboard=False), out.sinks),
      SignalHook(log, cfg.sampling.max_new_tokens),
    ),
  )
  return driver.make_hooks(cfg, out, ckpt, start, log, spec, user)


def _banner(cfg: TrainConfig, p: pieces.Pieces) -> str:
  reward = f", reward {cfg.task.reward}" if cfg.task.reward else ""
  return (
    f"jetrl RL: recipe={cfg.recipe} model={pieces.describe_model(cfg.model)} "
    f"({p.mcfg.n_layers} layers, d_model "
    f"{p.mcfg.d_model}) task={cfg.task.name} ({cfg.task.prompt_format} prompts{reward}) "
    f"steps={cfg.steps} rows/step={cfg.rows} stop ids={list(pieces.token_ids(p.tok).stop)} "
    f"on {jax.devices()[0].platform}"
  )


def _run(cfg: TrainConfig, log, given=None, reward=None, *, user=()) -> dict:
  p = _pieces(cfg, log, given, reward)
  log(_banner(cfg, p))
  ckpt = Checkpointer(cfg.workdir, cfg.checkpoint.keep)
  state, start, data_pos = _restore(cfg, ckpt, _initial_state(cfg, p, log), log)
  out = driver.open_outputs(cfg, driver.RL, start, log)
  rl_step = _rl_step(cfg, p)
  hooks = _hooks(cfg, p, out, ckpt, start, log, user)
  loop = LoopState(state=state, data_pos=data_pos)
  if start == 0:
    hooks.evaluation(0, loop)
  step = functools.partial(_step, rl_step, start, log)
  driver.run_steps(cfg, out, hooks, loop, start, step, log)
  parallel.barrier("jetrl:run-end")  # the primary's last records are written
  return _finish(cfg, out, hooks, loop)


def _finish(cfg: TrainConfig, out: driver.Outputs, hooks: driver.Hooks, loop: LoopState) -> dict:
  evals = hooks.evaluation.writer.records()
  summary = dict(
    workdir=cfg.workdir,
    steps=cfg.steps,
    recipe=cfg.recipe,
    eval_before=evals[0]["eval_accuracy"] if evals else None,
    eval_after=evals[-1]["eval_accuracy"] if evals else None,
    skipped_updates=int(loop.state.skipped),
  )
  return driver.finish(out, hooks, summary)
