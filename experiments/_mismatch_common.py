"""What experiments/mismatch_floor.py and mismatch_length.py share: the training forward's
log-probs of a rollout's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetrl.rl.batch import make_train_batch, policy_logprobs


def rollout_batch(out):
  """The update batch of a rollout's samples (advantages 0: only the log-probs are used)."""
  rows = out.tokens.shape[0]
  return make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, jnp.zeros(rows)
  )


def train_logprobs(model_config, precision, temperature: float):
  """f(params, batch) -> the training forward's [B, T] log-probs of the batch's tokens."""
  fn = jax.jit(policy_logprobs, static_argnames=("model_config", "precision", "temperature"))
  kw = dict(model_config=model_config, precision=precision, temperature=temperature)
  return lambda params, batch: fn(params, batch=batch, **kw)[0]
