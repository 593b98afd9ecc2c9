"""Evaluation on a task's held-out problems: what a run's evaluations (`jetrl.train.loop`,
`jetrl.train.sft`) and `jetrl.train.evaluate.run_eval` compute, the same numbers for the same
params, sampled as the run's rollouts are (its stop ids, its precision)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import numpy as np

from jetrl.precision import Precision
from jetrl.sampling import SamplingConfig, sample
from jetrl.train.pieces import Pieces, prompt_width, token_ids
from jetrl.train.nodes import EvalConfig
from jetrl.train.scoring import score_rollout


def evaluate(
  params,
  pieces: Pieces,
  precision: Optional[Precision],
  eval_cfg: EvalConfig,
  *,
  max_new_tokens: int,
  split: str = "test",
  seed: int = 0,
  log: Optional[Callable[[str], None]] = None,
) -> dict:
  """Accuracy (by the task's own checker, `Task.checker`, whatever reward trains the policy),
  mean reward and mean length on the first `eval_cfg.size` problems of a held-out split,
  `eval_cfg.batch` problems per sampler call: greedy (temperature 0), or the mean over `eval_cfg.samples`
  completions per problem drawn at `eval_cfg.temperature` from a fixed key (`seed`), so that
  two policies evaluated alike see the same random numbers. Prompts are `encode(text)`
  (default: plain); samples stop on every stop id of the tokenizer. With `log` and more than
  one batch, a line after each batch says how far it is ("eval: 64/256 problems").

  `pieces` gives the model config, the task, the tokenizer, the prompt encoder and the
  sampling layout; on a mesh (params placed on that layout) prompt rows are split over its
  batch axes, every process scores its own rows and the results are gathered."""
  mcfg, task, tok, encode, layout = (
    pieces.mcfg,
    pieces.task,
    pieces.tok,
    pieces.encode,
    pieces.sample_layout,
  )
  size, batch, temperature = eval_cfg.size, eval_cfg.batch, eval_cfg.temperature
  problems = task.batch(split, 0, size)
  ids = token_ids(tok)
  scores, correct, lengths = [], [], []
  t0 = time.time()
  for i in range(0, size, batch):
    chunk = problems[i : i + batch]
    prompts = [encode(p.prompt) for p in chunk]
    sc = SamplingConfig(
      max_new_tokens=max_new_tokens,
      temperature=float(temperature),
      n=eval_cfg.samples if temperature > 0 else 1,
      stop_ids=ids.stop,
      pad_id=ids.pad,
      prompt_len=prompt_width(prompts),
    )
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    out = sample(params, mcfg, prompts, key, sc, precision, layout=layout)
    rewards, right, lens, _ = score_rollout(task, tok, chunk, out, sc.n)
    scores += list(rewards)
    correct += list(right)
    lengths += list(lens)
    if log is not None and size > batch:
      log(f"  eval: {min(i + batch, size)}/{size} problems ({time.time() - t0:.0f}s)")
  return {
    "eval_accuracy": float(np.mean(correct)),
    "eval_reward": float(np.mean(scores)),
    "eval_length": float(np.mean(lengths)),
  }
