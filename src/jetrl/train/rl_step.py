"""One RL step: prompts -> sampler (recipe.rollout) -> rewards -> advantages -> update
(recipe.train) -> the step's metric record.

PRNG keys are derived from (seed, step) and the problems from the data position, so the step
is a function of the train state, the step number and the data position: a resumed run
reproduces an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl import parallel
from jetrl.train.progress import ticking
from jetrl.models.lora import attach
from jetrl.rl import metrics as names
from jetrl.rl import (
  compute_advantages,
  dynamic_sampling_mask,
  make_train_batch,
  overlong_penalty,
  truncation_mask,
)
from jetrl.sampling import STOP_LENGTH, SamplingConfig, sample
from jetrl.train import pieces, scoring
from jetrl.train.pieces import Pieces
from jetrl.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class RLStep:
  """The pieces of an RL step, built once per run (`jetrl.train.loop`)."""

  cfg: TrainConfig
  pieces: Pieces  # tokenizer, task, prompt encoder, model config, recipe, layouts
  sampling: SamplingConfig  # cfg.sampling with the tokenizer's ids and the prompt width
  update_fn: Callable  # jetrl.rl.update_step, or its sharded version
  bin_edges: tuple[int, ...]

  def __call__(self, state, step: int, data_pos: int, log: Optional[Callable] = None):
    """(new state, the record of step `step + 1`, the new data position, the step's samples
    when `--logging.samples_every` says so, else None)."""
    cfg, u = self.cfg, self.cfg.update
    n = cfg.sampling.n
    k_sample, k_update = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step))
    problems = self.pieces.task.batch("train", data_pos, cfg.prompts_per_step)
    prompts = [self.pieces.encode(p.prompt) for p in problems]

    t_reshard, rollout_params = 0.0, state.params
    if state.frozen is not None:  # a LoRA run: its adapters on the frozen base
      rollout_params = attach(state.frozen, state.params, cfg.lora)
    if self.pieces.layout is not None:
      rollout_params, t_reshard = parallel.switch_layout(
        state.params, self.pieces.layout, self.pieces.sample_layout, log
      )
    t0 = time.time()
    with ticking("compiling the sampler (first step only)", log):  # log: the first step's
      out = sample(
        rollout_params,
        self.pieces.mcfg,
        prompts,
        k_sample,
        self.sampling,
        self.pieces.recipe.rollout,
        layout=self.pieces.sample_layout,
        kernels=self.pieces.kernels,
      )
      jax.block_until_ready(out.tokens)
    del rollout_params
    t_roll = time.time() - t0

    # Rewards where the completions are (each process scores its rows), gathered; the
    # advantages are then computed identically on every process from the gathered rewards.
    rewards, correct, lengths, stop_reason = scoring.score_rollout(
      self.pieces.task, self.pieces.tok, problems, out, n
    )
    shaped = jnp.asarray(rewards)  # this process's own device: the same values everywhere
    if u.overlong_buffer:
      shaped = shaped + overlong_penalty(
        jnp.asarray(lengths), cfg.sampling.max_new_tokens, u.overlong_buffer
      )
    adv = compute_advantages(shaped, n, u.resolved_advantage)
    # The batch is assembled from the rollout's arrays where they are (sharded by rows on a
    # mesh) and the per-row vectors, placed like them.
    rows = self._rows
    mask, n_dropped = out.mask, 0
    if u.dynamic_sampling:
      keep, n_dropped = dynamic_sampling_mask(shaped, n)
      mask = mask & rows(np.repeat(np.asarray(keep), n)[:, None])
    if u.mask_truncated:
      mask = truncation_mask(rows(stop_reason == STOP_LENGTH), mask)
    batch = make_train_batch(
      out.prompt_tokens, out.prompt_mask, out.tokens, mask, out.logprobs, rows(adv), out.routes
    )
    t_reward = time.time() - t0 - t_roll

    t1 = time.time()
    if self.pieces.layout is not None:
      batch = self.pieces.layout.shard_batch(batch)
    with ticking("compiling the update (first step only)", log):
      state, m = self.update_fn(
        state,
        batch,
        k_update,
        model_config=self.pieces.mcfg,
        cfg=u,
        optimizer=cfg.optimizer,
        total_steps=cfg.optimizer_steps,
        precision=self.pieces.recipe.train,
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        bin_edges=self.bin_edges,
        lora=cfg.lora if cfg.lora.enabled else None,
        kernels=self.pieces.kernels,
      )
      jax.block_until_ready(state.params)
    t_update = time.time() - t1
    row_dlogp = m.pop(names.AGREE_ROW_ABS_DIFF_MEAN, None)  # per row: the table's, not the record's
    samples = None
    every = cfg.logging.samples_every
    if every is not None and (step + 1) % every == 0:
      samples = self._samples(step + 1, problems, out, rewards, correct, row_dlogp, batch.mask)

    record = dict(
      reward_mean=float(shaped.mean()),
      accuracy=float(correct.mean()),
      response_length=float(lengths.mean()),
      truncated_frac=float((stop_reason == STOP_LENGTH).mean()),
      groups_dropped=float(n_dropped),
      flat_groups=float(np.mean(np.all(np.asarray(adv).reshape(-1, n) == 0, axis=1))),
      **m,
      **{
        "time/rollout": t_roll,
        "time/reward": t_reward,
        "time/update": t_update,
        "time/reshard": t_reshard,
        "tokens_per_s/rollout": int(lengths.sum()) / max(t_roll, 1e-9),
        "tokens_per_s/update": float(jnp.sum(batch.mask)) / max(t_update, 1e-9),
      },
    )
    record[names.AGREE_PREFIX + "bin_edges"] = list(self.bin_edges)
    return state, record, data_pos + cfg.prompts_per_step, samples

  def _rows(self, x):
    """A per-row host vector placed like the rollout's rows (as it is on one device)."""
    x = np.asarray(x)
    if self.pieces.layout is None:
      return x
    return parallel.put(x, self.pieces.layout.rows_sharding(x.shape[0], strict=True))

  def _samples(self, step: int, problems, out, rewards, correct, row_dlogp, mask) -> list[dict]:
    """The step's completions table, records of samples.jsonl (`--logging.samples_every`):
    one row per distinct prompt (the first of its `--sampling.n` completions), for the first
    `--logging.samples_rows` prompts (none: every prompt), with the checker's verdict and the
    row's mean |training - rollout log-prob| over its tokens (None for a row the update did
    not train on: dropped or masked). Every process gathers the arrays (a collective), the
    primary writes them."""
    n = self.cfg.sampling.n
    tokens, lengths, dlogp, mask = parallel.to_host((out.tokens, out.lengths, row_dlogp, mask))
    stop = set(pieces.token_ids(self.pieces.tok).stop)
    prompts = len(problems)
    if self.cfg.logging.samples_rows is not None:
      prompts = min(prompts, self.cfg.logging.samples_rows)
    records = []
    for p_i in range(prompts):
      r = p_i * n
      length = int(lengths[r])
      ids = [int(t) for t in tokens[r, :length]]
      text = pieces.decode(self.pieces.tok, ids[:-1] if ids and ids[-1] in stop else ids)
      p = problems[p_i]
      trained = dlogp is not None and bool(np.any(mask[r]))
      records.append(
        dict(
          step=step,
          row=r,
          prompt=p.prompt,
          answer=str(p.answer),
          completion=text,
          tokens=ids,
          length=length,
          reward=float(rewards[r]),
          correct=bool(correct[r]),
          abs_dlogp=float(dlogp[r]) if trained else None,
        )
      )
    return records


def console_fields(record: dict) -> tuple[dict, str]:
  """The console line of an RL step: key metrics (`trunc`: the share of samples that hit the
  generation budget), and the step's time split."""
  fields = {
    "reward": record["reward_mean"],
    "acc": record["accuracy"],
    "len": record["response_length"],
    "trunc": record["truncated_frac"],
    "grad_norm": float(names.read(record, names.GRAD_NORM)),
    "|dlogp|": float(names.read(record, names.AGREE_ABS_DIFF_MEAN)),
  }
  return fields, f"{record['time/rollout']:.1f}s rollout {record['time/update']:.1f}s update"
