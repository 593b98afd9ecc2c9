"""Reward functions for GSM8K and MATH, in the TRL shape.

Each takes (prompts, completions, answers) and returns one float per completion. A completion is
a str, or a TRL-style conversation (a list of {"role", "content"} messages: the last message's
content is scored). Prompts are accepted for the shape and not used; they may be None. The
functions are pure Python, deterministic, and never raise on a malformed completion: no answer,
unbalanced braces, a huge number, other Unicode digits, or a non-string all score 0.

GSM8K (`gsm8k_reward`): the completion's answer slot is the line after its last `####`, else
its last `\\boxed{}`, else (no slot) the last number in the text (this order is the `order`
argument). A slot must hold exactly one number in an accepted spelling
(`jetrl.data.number_answer`, the table in docs/tasks.md), else the completion has no answer.
Numbers are compared exactly in canonical form (separators, `$`, a leading `+`, leading zeros
and trailing zeros of decimals dropped). The reference answer may be the bare number ("1,080")
or a whole GSM8K worked answer ending in `#### 1,080`.

MATH (`math_reward`): the completion's answer is the contents of its last `\\boxed{}` or
`\\fbox{}`; it is compared with the reference by `math_equal` (normalised strings, exact
rationals, tuples, then sympy with a time limit per answer). `batch_timeout` seconds bound the
whole call: every completion is first compared without sympy (in time linear in their
length); then the worker is started if it is not running, and each completion still undecided
gets the same share of the time left, `min(timeout, 0.9 * left / undecided)`, for all its
sympy comparisons, a worker restart included. So one completion's cost never changes another's
reward (a right answer scores 1 wherever it stands), and a batch of hostile answers costs at
most about `batch_timeout` seconds, however many there are. Comparisons that run out of time
score 0 (counted in `jetrl.data.math_equivalence.worker_stats()`).

Format term: with `format_weight=w`, a completion also gets w when its answer is in the asked
form (`####` or `\\boxed{}` holding a number for GSM8K; a balanced `\\boxed{}` for MATH), so a
right answer in the right form scores 1 + w. It is off (w = 0) by default.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from jetrl.data.answer_extraction import (
  DEFAULT_GSM8K_ORDER,
  GSM8K_EXTRACTORS,
  boxed_number,
  extract_boxed,
  gsm8k_answer,
  hash_number,
)
from jetrl.data.math_equivalence import DEFAULT_TIMEOUT, math_equal
from jetrl.data.math_equivalence import count_over_budget as worker_stats_over_budget
from jetrl.data.sympy_client import deadline_left, start_worker
from jetrl.data.number_answer import read_number
from jetrl.data.task import check_reward_args, completion_text

DEFAULT_BATCH_TIMEOUT = 10.0  # seconds of sympy time per math_reward call
SHARE_OF_LEFT = 0.9  # of the batch's time left, shared out; the rest absorbs per-request costs


def check_gsm8k_order(order: Sequence[str]) -> tuple[str, ...]:
  order = tuple(order) if not isinstance(order, str) else (order,)
  if not order or any(o not in GSM8K_EXTRACTORS for o in order) or len(set(order)) != len(order):
    raise ValueError(f"order must be distinct names from {list(GSM8K_EXTRACTORS)}, got {order!r}")
  return order


def gsm8k_reference(answer: Any) -> str | None:
  """The canonical reference number from a bare answer or a worked answer with `####`."""
  if not isinstance(answer, str):
    answer = str(answer) if isinstance(answer, (int, float)) else None
  if answer is None:
    return None
  return read_number(answer) or hash_number(answer)


def gsm8k_format_ok(completion: Any) -> bool:
  text = completion_text(completion)
  return text is not None and (hash_number(text) is not None or boxed_number(text) is not None)


def math_format_ok(completion: Any) -> bool:
  text = completion_text(completion)
  return text is not None and extract_boxed(text) is not None


def gsm8k_reward(
  prompts: Sequence[str] | None,
  completions: Sequence[Any],
  answers: Sequence[Any],
  *,
  order: Sequence[str] = DEFAULT_GSM8K_ORDER,
  format_weight: float = 0.0,
) -> list[float]:
  """1.0 per completion whose final number equals the reference (+ the format term)."""
  check_reward_args(prompts, completions, answers)
  order = check_gsm8k_order(order)
  out = []
  for completion, answer in zip(completions, answers):
    try:
      text = completion_text(completion)
      gold = gsm8k_reference(answer)
      found = None if text is None else gsm8k_answer(text, order)
      score = 1.0 if found is not None and gold is not None and found == gold else 0.0
      if format_weight:
        score += format_weight * gsm8k_format_ok(text)
    except Exception:  # never raise on a malformed completion
      score = 0.0
    out.append(score)
  return out


def check_timeouts(timeout: Any, batch_timeout: Any) -> tuple[float, float]:
  """(timeout, batch_timeout) as floats; ValueError unless both are positive and finite."""
  for name, value in (("timeout", timeout), ("batch_timeout", batch_timeout)):
    if (
      isinstance(value, bool)
      or not isinstance(value, (int, float))
      or not (math.isfinite(value) and value > 0)
    ):
      raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
  return float(timeout), float(batch_timeout)


def math_reward(
  prompts: Sequence[str] | None,
  completions: Sequence[Any],
  answers: Sequence[Any],
  *,
  timeout: float = DEFAULT_TIMEOUT,
  batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
  symbolic: bool = True,
  format_weight: float = 0.0,
) -> list[float]:
  """1.0 per completion whose last `\\boxed{}` equals the reference answer (+ format term)."""
  check_reward_args(prompts, completions, answers)
  timeout, batch_timeout = check_timeouts(timeout, batch_timeout)
  deadline = time.monotonic() + batch_timeout  # the whole call, string checks included
  pairs, ok = [], []
  for c, a in zip(completions, answers):
    p = None
    if time.monotonic() <= deadline:
      p = _math_pair(c, a)
    else:
      worker_stats_over_budget()
    pairs.append(p)
    ok.append(p is not None and math_equal(*p, symbolic=False))
  undecided = [k for k, p in enumerate(pairs) if p is not None and not ok[k]]
  if symbolic and undecided and start_worker(deadline):
    # Every undecided completion gets the same share of what is left of the batch's time (at
    # most `timeout`), whatever the others cost: a right answer scores 1 wherever it stands.
    share = min(timeout, SHARE_OF_LEFT * deadline_left(deadline) / len(undecided))
    for k in undecided:
      mine = min(deadline, time.monotonic() + share)
      ok[k] = share > 0 and math_equal(*pairs[k], timeout=share, deadline=mine)
  out = []
  for p, good in zip(pairs, ok):
    score = 1.0 if good else 0.0
    if format_weight:
      score += format_weight * (p is not None)
    out.append(score)
  return out


def _math_pair(completion: Any, answer: Any) -> tuple[str, str] | None:
  """(boxed answer of the completion, reference answer), or None without a box."""
  try:
    text = completion_text(completion)
    found = None if text is None else extract_boxed(text)
    if found is None:
      return None
    gold = answer if isinstance(answer, str) else str(answer)
    boxed_gold = extract_boxed(gold)
    return found, gold if boxed_gold is None else boxed_gold
  except Exception:  # never raise on a malformed completion
    return None


def gsm8k_format_reward(
  prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[Any] | None = None
) -> list[float]:
  """1.0 per completion whose final number is marked (`#### n` or `\\boxed{n}`)."""
  return [1.0 if _safe(gsm8k_format_ok, c) else 0.0 for c in completions]


def math_format_reward(
  prompts: Sequence[str] | None, completions: Sequence[Any], answers: Sequence[Any] | None = None
) -> list[float]:
  """1.0 per completion with a balanced `\\boxed{}`."""
  return [1.0 if _safe(math_format_ok, c) else 0.0 for c in completions]


def _safe(fn, completion) -> bool:
  try:
    return bool(fn(completion))
  except Exception:
    return False
