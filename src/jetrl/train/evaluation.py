"""Evaluation on a task's held-out problems: what a run's evaluations (`jetrl.train.loop`,
`jetrl.train.sft`) and `jetrl.train.evaluate.run_eval` compute, the same numbers for the same
params, sampled as the run's rollouts are (its stop ids, its precision)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import numpy as np

from jetrl import parallel
from jetrl.data.task import answer_extractor
from jetrl.precision import Precision
from jetrl.sampling import SamplingConfig, sample
from jetrl.train.pieces import Pieces, prompt_width, token_ids
from jetrl.train.nodes import EvalConfig
from jetrl.train.pass_at_k import at_k_metrics
from jetrl.train.scoring import decode_rows, score_rollout


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
  table: Optional[list] = None,
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
  batch axes, every process scores its own rows and the results are gathered.

  With `eval_cfg.k` (sampled), also eval_pass_at_K and eval_maj_at_K for each k
  (`jetrl.train.pass_at_k`; maj@k only for a task with `extract_answer`). `table`: a list
  that gets one record per completion (problem, sample, prompt, completion, answer, the
  extracted answer, reward, correct, length), the evaluation's completions table."""
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
  scores, correct, lengths, found = [], [], [], []
  extract = answer_extractor(task)
  texts_needed = bool(eval_cfg.k) or table is not None
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
    out = sample(params, mcfg, prompts, key, sc, precision, layout=layout, kernels=pieces.kernels)
    rewards, right, lens, _ = score_rollout(task, tok, chunk, out, sc.n)
    scores += list(rewards)
    correct += list(right)
    lengths += list(lens)
    if texts_needed:  # every process decodes every row (a collective gather)
      toks, tlens = parallel.to_host((out.tokens, out.lengths))
      texts = decode_rows(tok, toks, tlens)
      answers = [None if extract is None else extract(t) for t in texts]
      found += answers
      for r, text in enumerate(texts):
        if table is not None:
          p = chunk[r // sc.n]
          table.append(
            dict(
              problem=i + r // sc.n,
              sample=r % sc.n,
              prompt=p.prompt,
              completion=text,
              answer=str(p.answer),
              extracted=answers[r],
              reward=float(rewards[r]),
              correct=bool(right[r]),
              length=int(lens[r]),
            )
          )
    if log is not None and size > batch:
      log(f"  eval: {min(i + batch, size)}/{size} problems ({time.time() - t0:.0f}s)")
  res = {
    "eval_accuracy": float(np.mean(correct)),
    "eval_reward": float(np.mean(scores)),
    "eval_length": float(np.mean(lengths)),
  }
  if eval_cfg.k and temperature > 0:
    n = eval_cfg.samples
    answers = None if extract is None else [found[j : j + n] for j in range(0, len(found), n)]
    res.update(at_k_metrics(np.reshape(correct, (-1, n)), answers, eval_cfg.k))
  return res


def at_k_line(res: dict, ks) -> str:
  """ "pass@1 0.250 pass@4 0.625 maj@4 0.500" of an evaluation's result (maj@k unavailable
  said once when the task extracts no answers); "" without k."""
  parts = []
  for k in ks:
    if f"eval_pass_at_{k}" in res:
      parts.append(f"pass@{k} {res[f'eval_pass_at_{k}']:.3f}")
    if f"eval_maj_at_{k}" in res:
      parts.append(f"maj@{k} {res[f'eval_maj_at_{k}']:.3f}")
  if parts and not any(key.startswith("eval_maj_at_") for key in res):
    parts.append("(maj@k unavailable: the task gives no extracted answers)")
  return " ".join(parts)
