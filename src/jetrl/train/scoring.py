"""Scoring a rollout: its completions decoded on the host and given to the task's reward, the
values checked finite in float32 (the precision the advantages are computed in), whether each
is correct by the task's own checker (`Task.checker`: the task's reward even when another
reward trains the policy), and, with several processes, each process scoring the rows it
holds."""

from __future__ import annotations

import numpy as np

from jetrl import parallel
from jetrl.data.tokenizer import stop_token_ids
from jetrl.data.user_reward import RewardError


def _decode(tok, ids) -> str:
  return tok.decode([int(i) for i in ids])


def score_rows(task, tok, problems, tokens, lengths):
  """(texts, rewards, correct) of completion rows: `problems[i]` is row i's problem, `tokens`
  [R, T] and `lengths` [R] its sampled ids (numpy); a trailing stop id is not part of the
  text. `correct` (bool) is the task's checker's reward >= 1, the checker called only when it
  is not the task that gave the rewards."""
  texts = decode_rows(tok, tokens, lengths)
  prompts = [p.prompt for p in problems]
  answers = [p.answer for p in problems]
  rewards = checked_rewards(task, task.reward(prompts, texts, answers))
  checker = getattr(task, "checker", task)
  if checker is task:
    return texts, rewards, rewards >= 1.0
  return texts, rewards, checked_rewards(checker, checker.reward(prompts, texts, answers)) >= 1.0


def decode_rows(tok, tokens, lengths) -> list[str]:
  """The text of each completion row (numpy `tokens` [R, T], `lengths` [R]); a trailing stop
  id is not part of it."""
  toks, lens = np.asarray(tokens), np.asarray(lengths)
  stop = set(stop_token_ids(tok) or (int(tok.eos_token_id),))
  texts = []
  for row, n in zip(toks, lens):
    row = row[:n]
    texts.append(_decode(tok, row[:-1] if n and int(row[-1]) in stop else row))
  return texts


def checked_rewards(task, values) -> np.ndarray:
  """A reward call's values as float32; RewardError when one is not finite once cast (1e300
  is finite as a Python float and Inf in float32)."""
  with np.errstate(over="ignore", invalid="ignore"):
    out = np.asarray(np.asarray(values, np.float64), np.float32)
  bad = np.flatnonzero(~np.isfinite(out))
  if bad.size:
    raise RewardError(
      f"the reward of task {getattr(task, 'name', type(task).__name__)!r} returned "
      f"{bad.size} values that are not finite in float32 (the first: "
      f"{float(np.asarray(values, np.float64)[bad[0]])!r} at position {int(bad[0])}); a "
      "reward must be finite and within float32's range"
    )
  return out


def completions_and_rewards(task, tok, problems, rollout, group: int):
  """(texts, rewards) of a rollout's completions, decoded on the host; rows are prompt-major."""
  return score_rows(
    task, tok, [p for p in problems for _ in range(group)], rollout.tokens, rollout.lengths
  )[:2]


def score_rollout(task, tok, problems, rollout, group: int):
  """(rewards, correct, lengths, stop reasons) of every row of a rollout, as numpy, on every
  process (`correct`: bool, by the task's checker; `score_rows`).

  Each process decodes and scores the rows it holds (`jetrl.parallel.owned_rows`; all of them
  with one process) and the rewards are gathered: reward functions run where the completions
  are, and no process reads another's shards. Rows are prompt-major (`group` per problem)."""
  rows = parallel.owned_rows(rollout.tokens)
  _, rewards, correct = score_rows(
    task,
    tok,
    [problems[int(r) // group] for r in rows],
    parallel.rows_to_host(rollout.tokens, rows),
    parallel.rows_to_host(rollout.lengths, rows),
  )
  n = rollout.tokens.shape[0]
  both = parallel.gather_rows(np.stack([rewards, correct.astype(np.float32)], 1), rows, n)
  lengths, stop = parallel.to_host((rollout.lengths, rollout.stop_reason))
  return both[:, 0], both[:, 1] > 0.5, np.asarray(lengths), np.asarray(stop)
