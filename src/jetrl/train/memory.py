"""A lower bound on the memory an RL or SFT step needs, checked before anything is built.

`--prompts_per_step=100000000` once grew host memory for minutes with no output. The batch-
shaped flags (prompts per step, group size, generation budget, micro-batches) now meet an
estimate first: the arrays a step must hold at once (params, AdamW state and gradients, the
rollout's KV cache and last logits, one micro-batch's saved activations and log-prob chunk),
summed over the whole batch and compared with the memory of every device of this process
together (host RAM for CPU devices). Only terms that every implementation must hold are
counted, so the estimate is a floor: a run it refuses cannot fit however it is sharded, and a
run it accepts may still not fit. The evaluation's sampler calls (`--eval.batch` problems x
`--eval.samples` completions a call) meet the same kind of floor, `eval_bytes`: the params (and
a run's optimizer state) stay in memory while it runs. See docs/reliability.md.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from jetrl.models.cache import cache_bytes
from jetrl.models.config import ModelConfig
from jetrl.precision import Recipe
from jetrl.train.validation import FlagError

GIB = 1024**3


def _cache_kind(recipe: Optional[Recipe]) -> tuple[int, dict]:
  """(bytes of a value between operators, how the rollout's KV cache is laid out: whether it
  keeps value exponents (a batch-invariant precision's cache in the compute dtype) and whether
  it is an FP8 one, as `cache_bytes` takes them) under `recipe` (None: bf16)."""
  if recipe is None:
    return 2, {}
  fp8 = recipe.rollout.kv_cache == "fp8"
  return recipe.compute_bytes, {
    "value_exponents": recipe.rollout.batch_invariant and not fp8,
    "fp8": fp8,
  }


def step_bytes(
  mcfg: ModelConfig,
  *,
  rows: int,
  seq_len: int,
  micro_rows: int,
  master_bytes: int = 4,
  recipe: Optional[Recipe] = None,
  ref_params: bool = False,
  chunk: int = 256,
) -> dict[str, int]:
  """Bytes by part (see the module docstring); every part is needed at some point of a step
  under `recipe` (its compute dtype's size, and its rollout cache; None: bf16)."""
  compute_bytes, cache_kind = _cache_kind(recipe)
  n = mcfg.n_params
  per_token = 2 * mcfg.d_model + 2 * mcfg.q_dim + 2 * mcfg.kv_dim + 3 * mcfg.d_ff
  return {
    "params, AdamW state, gradients": n * (master_bytes * (2 if ref_params else 1) + 8 + 4),
    "rollout KV cache": cache_bytes(mcfg, rows, seq_len, compute_bytes, **cache_kind),
    "rollout logits": rows * mcfg.vocab_size * 4,
    "update activations": micro_rows * seq_len * mcfg.n_layers * per_token * compute_bytes,
    "update log-prob chunk": micro_rows * min(chunk, seq_len) * mcfg.vocab_size * 4,
  }


# The narrowest prompt a sampler call holds: `pieces.prompt_width` rounds up to 16 tokens.
MIN_PROMPT_WIDTH = 16


def eval_bytes(
  mcfg: ModelConfig,
  *,
  rows: int,
  max_new_tokens: int,
  resident: int,
  prompt_width: int = MIN_PROMPT_WIDTH,
  recipe: Optional[Recipe] = None,
) -> dict[str, int]:
  """Bytes by part of one evaluation sampler call of `rows` rows (`EvalConfig.rows`) that
  generates `max_new_tokens` after prompts `prompt_width` wide under `recipe`'s rollout,
  while `resident` bytes (the params, and a run's optimizer state) stay where they are."""
  compute_bytes, cache_kind = _cache_kind(recipe)
  seq_len = prompt_width + max_new_tokens
  return {
    "params and optimizer state": resident,
    "evaluation KV cache": cache_bytes(mcfg, rows, seq_len, compute_bytes, **cache_kind),
    "evaluation logits": rows * mcfg.vocab_size * 4,
  }


def check_eval_memory(parts: dict[str, int], flags: str, *, available=None) -> int:
  """FlagError naming `flags` when one evaluation call (its `eval_bytes` parts) cannot fit."""
  return check_step_memory(
    parts,
    flags,
    available=available,
    processes=jax.process_count(),
    what="one evaluation call",
    remedy="lower them",
  )


def available_bytes() -> tuple[int, str]:
  """(bytes, what) of memory for this process's devices: their limits, or host RAM for CPU."""
  devices = jax.local_devices()
  limits = []
  for d in devices:
    stats = d.memory_stats() if d.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
      limits.append(int(stats["bytes_limit"]))
  if limits and len(limits) == len(devices):
    return sum(limits), f"{len(devices)} {devices[0].platform} device(s)"
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return int(ram), "host RAM"


def check_step_memory(
  parts: dict[str, int],
  flags: str,
  *,
  available: tuple[int, str] = None,
  processes: int = 1,
  what: str = "one step",
  remedy: str = "lower them (or raise --micro_batches)",
) -> int:
  """FlagError naming `flags` when the parts (divided over `processes`) exceed the memory
  that `what` (one step, one evaluation call) needs."""
  total = sum(parts.values()) // max(processes, 1)
  limit, where = available if available is not None else available_bytes()
  if total > limit:
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    detail = ", ".join(f"{k} {v / GIB:,.1f} GiB" for k, v in largest)
    raise FlagError(
      None,
      f"{flags}: {what} needs at least {total / GIB:,.1f} GiB ({detail}), "
      f"more than the {limit / GIB:,.1f} GiB of {where}; {remedy}",
    )
  return total
