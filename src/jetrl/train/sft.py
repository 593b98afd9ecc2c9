"""Supervised warm start on a task's gold solutions, so RL starts from a policy that knows the
answer format. Writes checkpoints that `--init_from` of the RL run reads.

It runs like the RL loop, with the same optimizer (`jetrl.rl.make_optimizer`) and, through
`jetrl.train.driver`, the same start-up and hooks:
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
import functools
import random
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jetrl.config import FlagError
from jetrl.data.synthetic import misreport
from jetrl.kernels import resolve_plan
from jetrl.train.progress import ticking
from jetrl.rl.batch import make_train_batch, policy_logprobs
from jetrl.rl.masking import masked_mean
from jetrl.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from jetrl.sampling import SamplingConfig, pad_prompts
from jetrl.train import pieces, driver, evaluation
from jetrl.train.checkpoint import Checkpointer
from jetrl.train.config import SFTConfig
from jetrl.train.hooks import Hook, LoopState
from jetrl.train.memory import check_eval_memory, check_step_memory, eval_bytes, step_bytes
from jetrl.train.plots import write_sft_plots

SKIP_HINT = "Check --optimizer.lr and the initial params (--model.name)."


def _solution_batch(tok, problems, width: int, t_max: int, encode=None):
  """The train batch of gold solutions after their prompts (`encode(text)`, default plain)."""
  encode = encode or (lambda text: pieces.encode_prompt(tok, text))
  prompts = [encode(p.prompt) for p in problems]
  sols = [pieces.encode_completion(tok, p.solution) for p in problems]
  too_long = [len(s) for s in sols if len(s) > t_max]
  if too_long:
    raise FlagError(
      "sampling.max_new_tokens",
      f"a gold solution has {max(too_long)} tokens, more than "
      f"the budget {t_max}; raise --sampling.max_new_tokens",
    )
  ids = pieces.token_ids(tok)
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
  gold solution longer than --sampling.max_new_tokens is an error before the first step."""
  if not cfg.mix_lengths:
    return [task], width
  tasks = []
  for length in cfg.mix_lengths:
    t, w = pieces.load_task(
      dataclasses.replace(cfg.task, length=int(length)), seed=cfg.seed, tok=tok, encode=encode
    )
    tasks.append(t)
    width = max(width, w)
  for t in tasks:
    try:
      _solution_batch(
        tok, t.batch("train", 0, cfg.batch_size), width, cfg.sampling.max_new_tokens, encode
      )
    except FlagError as e:
      raise FlagError(
        "sampling.max_new_tokens", f"at --mix_lengths {t.length}: {e.detail}"
      ) from None
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
  params,
  opt_state,
  batch,
  *,
  model_config,
  precision,
  optimizer: OptimizerConfig,
  total_steps: int,
  split_tokens=None,
  kernels=None,
):
  """One optimizer step on the mean token log-likelihood of the gold solutions.

  Returns (params, opt_state, loss, grad norm, ok, learning rate); a step whose loss,
  gradients or result is not finite is skipped (params and optimizer state unchanged, `ok`
  False). split_tokens: on a mesh, where the activations' rows live (`Layout.token_split`).
  kernels: the kernel settings (`--kernels.*`, a `KernelConfig`) or a `Device`, as
  `jetrl.rl.update_step` takes them (None: the environment's)."""
  plan = resolve_plan(precision, kernels)

  def loss_fn(p):
    logp, _ = policy_logprobs(
      p, model_config, batch, precision, split_tokens=split_tokens, plan=plan
    )
    return -masked_mean(logp, batch.mask)

  opt = make_optimizer(optimizer, total_steps)
  lr = learning_rate_schedule(optimizer, total_steps)(opt_state.applied)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, new_opt = opt.update(grads, opt_state, params, value=loss)
  ok = new_opt.last_ok
  new_params = jax.tree_util.tree_map(
    lambda a, b: jnp.where(ok, a, b), optax.apply_updates(params, updates), params
  )
  return new_params, new_opt, loss, optax.tree.norm(grads), ok, lr


_STATIC = ("model_config", "precision", "optimizer", "total_steps", "split_tokens", "kernels")
sft_step = jax.jit(_sft_step, static_argnames=_STATIC, donate_argnames=("params", "opt_state"))


def sharded_sft_step(layout, opt_state):
  """`sft_step` on `layout`'s mesh: params and optimizer state come back in the shardings they
  are placed with (`layout.shard_params`, `layout.shard_state`), the scalars replicated; each
  layer's activations keep their rows where the batch's rows are (`layout.token_split`)."""
  rep = layout.replicated
  step = functools.partial(_sft_step, split_tokens=layout.token_split)
  return jax.jit(
    step,
    static_argnames=_STATIC,
    donate_argnames=("params", "opt_state"),
    out_shardings=(layout.param_shardings, layout.tree_shardings(opt_state), rep, rep, rep, rep),
  )


def run_sft(cfg: SFTConfig, *, task=None, log=print, hooks: Sequence[Hook] = ()) -> dict:
  """Run (or resume) a supervised warm start; returns the greedy evaluation at the end (also in
  workdir/sft_summary.json). `task`: a `jetrl.data.Task` object instead of the one `cfg.task`
  names; `hooks`: as for `jetrl.train.run`. Errors as for `jetrl.train.run`."""
  user = driver.user_hooks(hooks, "run_sft")
  return driver.run_guarded(cfg, task, log, functools.partial(_run_sft, user=user))


def _pieces(cfg: SFTConfig, log, given, reward):
  """(the run's pieces, the tasks its steps take problems from), checked (gold solutions
  against the budget, tokenizer against the model, memory, mesh) before anything compiles."""
  recipe = cfg.precision_recipe
  tok, encode, task, width = driver.tokenizer_and_task(cfg, given, reward)
  train_tasks, width = mixed_tasks(cfg, task, width, tok, encode)
  mcfg = pieces.model_config(cfg.model, tok, width + cfg.sampling.max_new_tokens)
  check_step_memory(
    step_bytes(
      mcfg,
      rows=min(cfg.eval.size, 64),
      seq_len=width + cfg.sampling.max_new_tokens,
      micro_rows=cfg.batch_size,
      recipe=recipe,
    ),
    "--batch_size / --sampling.max_new_tokens",
    processes=jax.process_count(),
  )
  check_eval_memory(
    eval_bytes(
      mcfg,
      rows=cfg.eval.rows,
      max_new_tokens=cfg.sampling.max_new_tokens,
      resident=mcfg.n_params * (4 + 8),
      recipe=recipe,
    ),
    "--eval.batch / --eval.samples / --sampling.max_new_tokens",
  )
  layout, sample_layout = pieces.layouts(
    cfg.mesh, mcfg, recipe, {"--batch_size": cfg.batch_size}, log
  )
  run_pieces = pieces.Pieces(
    recipe, tok, encode, task, width, mcfg, layout, sample_layout, cfg.kernels
  )
  return run_pieces, train_tasks


def _initial_state(cfg: SFTConfig, p: pieces.Pieces):
  """({"params", "opt_state"} of a fresh start, the jitted step for their placement)."""
  params = pieces.make_params(cfg.model, p.mcfg, cfg.seed)
  if p.layout is not None:
    params = p.layout.shard_params(params)  # the optimizer state is then built sharded
    opt_state = p.layout.shard_state(make_optimizer(cfg.optimizer, cfg.steps).init(params))
    return {"params": params, "opt_state": opt_state}, sharded_sft_step(p.layout, opt_state)
  opt_state = make_optimizer(cfg.optimizer, cfg.steps).init(params)
  # Committed like a restored state, so a resumed run reuses the compiled step.
  params, opt_state = jax.device_put((params, opt_state), jax.local_devices()[0])
  return {"params": params, "opt_state": opt_state}, sft_step


class SFTStep:
  """One SFT step on the gold solutions of step i's problems; counts the skipped updates."""

  def __init__(
    self, cfg: SFTConfig, p: pieces.Pieces, train_tasks, step_fn, skipped: int, log=None, start=0
  ):
    self.cfg, self.p, self.train_tasks, self.step_fn = cfg, p, train_tasks, step_fn
    self.skipped = skipped  # skipped updates so far (the optimizer state's count at the start)
    self.log, self.start = log, start  # the process's first step (start + 1) compiles

  def batch(self, i: int):
    cfg, p = self.cfg, self.p
    first = i * cfg.batch_size
    problems = self.train_tasks[i % len(self.train_tasks)].batch("train", first, cfg.batch_size)
    if cfg.answer_noise:
      problems = misreported(problems, p.task, cfg, first)
    batch = _solution_batch(p.tok, problems, p.width, cfg.sampling.max_new_tokens, p.encode)
    if p.layout is not None:  # every process builds the same batch and places its rows
      batch = p.layout.shard_batch(batch)
    return batch

  def __call__(self, i: int, loop: LoopState) -> None:
    log = self.log if i == self.start else None  # the process's first step compiles
    batch = self.batch(i)
    with ticking("compiling the SFT step (first step only)", log):
      params, opt_state, loss, gnorm, ok, lr = self.step_fn(
        loop.state["params"],
        loop.state["opt_state"],
        batch,
        model_config=self.p.mcfg,
        precision=self.p.recipe.train,
        optimizer=self.cfg.optimizer,
        total_steps=self.cfg.steps,
        kernels=self.p.kernels,
      )
      ok = bool(ok)  # waits for the step
    loop.state = {"params": params, "opt_state": opt_state}
    loop.skipped = 0 if ok else 1
    self.skipped += loop.skipped
    loop.record = {
      "loss": loss,
      "grad_norm": gnorm,
      "skipped_updates": self.skipped,
      "learning_rate": lr,
    }


def _evaluate(cfg: SFTConfig, p: pieces.Pieces, loop: LoopState, log=None) -> dict:
  params = p.rollout_params(loop.state["params"])
  return evaluation.evaluate(
    params, p, p.recipe.rollout, cfg.eval, max_new_tokens=cfg.sampling.max_new_tokens, log=log
  )


def _hooks(cfg: SFTConfig, p, out: driver.Outputs, ckpt, start: int, log, user=()) -> driver.Hooks:
  spec = driver.HookSpec(
    evaluate=functools.partial(_evaluate, cfg, p, log=log),
    console=lambda r: ({"loss": float(r["loss"])}, None),
    skip_hint=SKIP_HINT,
    updates_per_step=1,
    tree=lambda loop: loop.state,
    meta=lambda loop: {},
    draw=write_sft_plots,
  )
  return driver.make_hooks(cfg, out, ckpt, start, log, spec, user)


def _run_sft(cfg: SFTConfig, log, given=None, reward=None, *, user=()) -> dict:
  p, train_tasks = _pieces(cfg, log, given, reward)
  log(
    f"jetrl SFT: task={cfg.task.name} ({cfg.task.prompt_format} prompts) model="
    f"{pieces.describe_model(cfg.model)} ({p.mcfg.n_layers} layers) "
    f"steps={cfg.steps} batch={cfg.batch_size} recipe={cfg.recipe}"
  )
  state, step_fn = _initial_state(cfg, p)
  ckpt = Checkpointer(cfg.workdir, cfg.checkpoint.keep)
  state, meta = driver.restore_or_start(cfg, driver.SFT, ckpt, state, log)
  start = 0 if meta is None else int(meta["step"])
  if meta is not None:
    log(f"resumed SFT at step {start} from {ckpt.restored}")
  out = driver.open_outputs(cfg, driver.SFT, start, log)
  hooks = _hooks(cfg, p, out, ckpt, start, log, user)
  loop = LoopState(state=state)
  step = SFTStep(cfg, p, train_tasks, step_fn, int(state["opt_state"].skipped), log, start)
  driver.run_steps(cfg, out, hooks, loop, start, step, log)
  return _finish(cfg, p, out, hooks, loop, log)


def _finish(cfg: SFTConfig, p, out: driver.Outputs, hooks: driver.Hooks, loop, log) -> dict:
  """The last evaluation (run now if no step ran), logged and written as sft_summary.json."""
  res = hooks.evaluation.last if hooks.evaluation.last is not None else _evaluate(cfg, p, loop)
  log(f"SFT done: {cfg.eval.label} {res['eval_accuracy']:.3f} on {cfg.eval.size} held-out problems")
  return driver.finish(out, hooks, dict(workdir=cfg.workdir, **res))
