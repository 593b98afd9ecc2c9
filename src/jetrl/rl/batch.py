"""From a rollout to the arrays the training forward sees.

A rollout row is a left-padded prompt [P] followed by a completion [T]. The training forward
runs over the whole sequence (inputs = sequence[:-1], targets = sequence[1:]) with the same
positions the sampler used, and the completion's log-probs sit at positions P-1 .. P+T-2.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jetrl.models.cache import positions_from_mask
from jetrl.models.logprobs import token_logprobs


class TrainBatch(NamedTuple):
  """Per-row arrays for the update. R rows; S = P + T - 1 input positions."""

  inputs: jax.Array  # [R, S] int32
  targets: jax.Array  # [R, T] int32: the completion tokens
  positions: jax.Array  # [R, S] int32
  attention_mask: jax.Array  # [R, S] bool
  mask: jax.Array  # [R, T] float32: completion tokens that count in the loss
  rollout_logprobs: jax.Array  # [R, T] float32
  advantages: jax.Array  # [R] float32
  # [R, T, L, k] int32: the experts a mixture of experts' rollout chose for each completion
  # token in each layer (`Rollout.routes`), or None.
  rollout_routes: Optional[jax.Array] = None


def make_train_batch(
  prompt_tokens, prompt_mask, tokens, mask, rollout_logprobs, advantages, rollout_routes=None
) -> TrainBatch:
  """Assemble a TrainBatch from the sampler's arrays and per-row advantages (and, for a
  mixture of experts, the rollout's routes: the routing agreement metrics)."""
  seq = jnp.concatenate([prompt_tokens, tokens], axis=1).astype(jnp.int32)
  seq_mask = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
  positions = positions_from_mask(seq_mask)
  return TrainBatch(
    inputs=seq[:, :-1],
    targets=tokens.astype(jnp.int32),
    positions=positions[:, :-1],
    attention_mask=seq_mask[:, :-1],
    mask=mask.astype(jnp.float32),
    rollout_logprobs=rollout_logprobs.astype(jnp.float32),
    advantages=jnp.asarray(advantages, jnp.float32),
    rollout_routes=None if rollout_routes is None else jnp.asarray(rollout_routes, jnp.int32),
  )


def completion_logprobs(logp_all: jax.Array, num_completion: int) -> jax.Array:
  """The last `num_completion` columns of per-position log-probs [R, S] -> [R, T]."""
  return logp_all[:, logp_all.shape[1] - num_completion :]


def pad_targets(batch: TrainBatch) -> jax.Array:
  """Targets aligned with `inputs` ([R, S]): prompt positions get token 0 (masked out)."""
  r, s = batch.inputs.shape
  t = batch.targets.shape[1]
  return jnp.concatenate([jnp.zeros((r, s - t), jnp.int32), batch.targets], axis=1)


def policy_logprobs(
  params,
  model_config,
  batch: TrainBatch,
  precision,
  temperature: float = 1.0,
  chunk_size: int = 256,
  remat: bool = False,
  split_tokens=None,
  top_k: Optional[int] = None,
  top_p: float = 1.0,
  plan=None,
  routing: bool = False,
):
  """Training-forward log-probs and entropies of the completion tokens: ([R, T], [R, T]);
  with `routing`, a third: the `Routing` of every input position [R, S, L, ...] (None for a
  dense model).
  split_tokens: on a mesh, where the activations' rows live (`models.hidden_states`);
  top_k, top_p: the sampler's truncation, applied to this forward's own logits
  (`token_logprobs`); plan: the kernels (`jetrl.kernels.Plan`; default: resolved for the
  precision)."""
  out = token_logprobs(
    params,
    model_config,
    batch.inputs,
    pad_targets(batch),
    precision=precision,
    positions=batch.positions,
    attention_mask=batch.attention_mask,
    temperature=temperature,
    chunk_size=chunk_size,
    remat=remat,
    split_tokens=split_tokens,
    top_k=top_k,
    top_p=top_p,
    plan=plan,
    routing=routing,
  )
  t = batch.targets.shape[1]
  logp, ent = completion_logprobs(out[0], t), completion_logprobs(out[1], t)
  return (logp, ent, out[2]) if routing else (logp, ent)
