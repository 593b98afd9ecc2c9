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


def train_logprobs(model_config, precision, sampling):
  """f(params, batch) -> the training forward's [B, T] log-probs of the batch's tokens, under
  the sampling config's temperature and top-k / top-p (the rule the rollout recorded by)."""
  static = ("model_config", "precision", "temperature", "top_k", "top_p")
  fn = jax.jit(policy_logprobs, static_argnames=static)
  kw = dict(
    model_config=model_config,
    precision=precision,
    temperature=sampling.temperature,
    top_k=sampling.top_k,
    top_p=sampling.top_p,
  )
  return lambda params, batch: fn(params, batch=batch, **kw)[0]
