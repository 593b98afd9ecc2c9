"""pass@k and maj@k of sampled completions (`--eval.k`).

pass@k: the unbiased estimator of the chance that at least one of k completions drawn without
replacement from a problem's n >= k is correct, 1 - C(n - c, k) / C(n, k) with c of the n
correct (Chen et al., 2021), averaged over the problems.

maj@k: over the first k completions of a problem, the most frequent extracted answer
(`jetrl.data.Task.extract_answer`; ties broken by first appearance; a completion with no
extractable answer never wins, and a problem with none has no vote); the problem counts when
the completions that gave the voted answer were judged correct by the task's checker (the
first of them), averaged over the problems. A task without `extract_answer` has no maj@k.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def pass_at_k(correct, k: int) -> float:
  """The mean over problems (rows of `correct`, [problems, n] bools) of the unbiased pass@k."""
  correct = np.asarray(correct, bool)
  n = correct.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} completions per problem")
  values = []
  for row in correct:
    c = int(row.sum())
    values.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
  return float(np.mean(values))


def majority(answers: Sequence[Optional[str]]) -> Optional[int]:
  """The index of the first completion giving the most frequent answer (None never wins),
  or None when no completion has one."""
  counts: dict[str, int] = {}
  first: dict[str, int] = {}
  for i, a in enumerate(answers):
    if a is not None:
      counts[a] = counts.get(a, 0) + 1
      first.setdefault(a, i)
  if not counts:
    return None
  best = max(counts.values())
  return min(first[a] for a, c in counts.items() if c == best)


def maj_at_k(correct, answers, k: int) -> float:
  """The share of problems whose majority answer over their first k completions is right:
  `correct` [problems, n] bools, `answers` [problems][n] extracted answers (or None)."""
  correct = np.asarray(correct, bool)
  if not 1 <= k <= correct.shape[1]:
    raise ValueError(f"maj@{k} needs 1 <= k <= n = {correct.shape[1]} completions per problem")
  hits = []
  for row, found in zip(correct, answers):
    i = majority(list(found)[:k])
    hits.append(i is not None and bool(row[i]))
  return float(np.mean(hits))


def at_k_metrics(correct, answers, ks: Sequence[int], prefix: str = "eval_") -> dict:
  """{prefix + "pass_at_K": ..., prefix + "maj_at_K": ...} for each k (maj@k only when
  `answers` is not None)."""
  out = {}
  for k in ks:
    out[f"{prefix}pass_at_{k}"] = pass_at_k(correct, k)
    if answers is not None:
      out[f"{prefix}maj_at_{k}"] = maj_at_k(correct, answers, k)
  return out
