"""The gradient the trainer computes, and how far another batch or another arithmetic moves it.

`trainer_gradient` is the gradient of the update's first optimizer step on a batch, as
`jetrl.rl.update.train_step` computes it (the pre-update forward for the PPO ratio's old
log-probs and the importance weights, then the loss over the batch as one minibatch): the
direction the policy moves in. The measures compare two such gradients as flat float64
vectors:

  cosine(a, b)               a . b / (|a| |b|)
  relative_difference(a, b)  |a - b| / |b|          (b the reference)

and, for the importance weights of a rollout under the training forward,

  sequence_ess(log_ratio)    (sum w)^2 / (n sum w^2), w = exp(log_ratio): the effective
                             fraction of the n rows a sequence-level correction keeps
  (the per-token TIS truncation rate is `jetrl.rl.correction.importance_weights`' metric).

The estimator's own noise is the baseline every comparison is read against: two independent
batches of the same estimator (a split half) differ by `cosine` and `relative_difference` too,
and a difference in the rows (rollout against the training forward's own samples) matters only
where it moves the gradient by a sizeable part of that.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.precision import Precision
from jetrl.rl.batch import TrainBatch
from jetrl.rl.agreement import DEFAULT_EDGES
from jetrl.rl.update import StepSpec, TrainState, accumulate, pre_update
from jetrl.rl.update_config import UpdateConfig


@functools.partial(jax.jit, static_argnames=("model_config", "cfg", "precision", "temperature"))
def trainer_gradient(
  params,
  batch: TrainBatch,
  *,
  model_config,
  cfg: UpdateConfig,
  precision: Optional[Precision],
  temperature: float,
):
  """(gradient, clipped): the gradient of the update's first optimizer step on `batch` (one
  minibatch of all its rows, `cfg.micro_batches` micro-batches), float32, shaped like
  `params`, and the fraction of its tokens whose PPO ratio the clip range cut off.

  With old log-probs recomputed, that ratio is pi_theta / pi_old between two forwards of the
  same params: 1 where the training forward gives the same log-probs inside the gradient's
  program as in the pre-update one, and clipped where the two programs' rounding differs by
  more than the clip range."""
  if cfg.minibatches != 1 or cfg.kl_coef > 0:
    raise ValueError(
      "trainer_gradient: the first step's gradient over the whole batch needs "
      f"update.minibatches = 1 and no reference policy (kl_coef 0); got minibatches="
      f"{cfg.minibatches}, kl_coef={cfg.kl_coef}"
    )
  spec = StepSpec(
    model_config=model_config,
    cfg=cfg,
    precision=precision,
    temperature=temperature,
    remat=False,
    max_tokens=cfg.max_tokens or batch.targets.shape[1],
  )
  state = TrainState(params=params, opt_state=None)
  extra, _, _ = pre_update(state, batch, spec, bin_edges=DEFAULT_EDGES)
  grads, _, aux = accumulate(params, batch, extra, spec)
  n_tok = jnp.maximum(aux["n_tokens"], 1.0)
  clipped = (aux["clip_frac_low"] + aux["clip_frac_high"]) / n_tok
  return grads, clipped


def flat(tree) -> np.ndarray:
  """A pytree of arrays as one float64 vector (leaves in tree order)."""
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    raise ValueError("flat: the tree has no arrays")
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])


def _vectors(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or a.ndim != 1:
    raise ValueError(f"expected two vectors of one length, got shapes {a.shape} and {b.shape}")
  return a, b


def cosine(a, b) -> float:
  """Cosine similarity of two vectors; NaN when either is zero."""
  a, b = _vectors(a, b)
  na, nb = np.linalg.norm(a), np.linalg.norm(b)
  if na == 0 or nb == 0:
    return float("nan")
  return float(a @ b / (na * nb))


def relative_difference(a, b) -> float:
  """|a - b| / |b| (b the reference); NaN when b is zero."""
  a, b = _vectors(a, b)
  nb = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / nb) if nb > 0 else float("nan")


def sequence_log_ratios(train_logp, rollout_logp, mask) -> np.ndarray:
  """Per row, sum_t mask * (train log p - rollout log p): the log of the sequence's
  importance ratio pi_train(y) / pi_rollout(y). float64 [R]."""
  d = np.asarray(train_logp, np.float64) - np.asarray(rollout_logp, np.float64)
  return np.sum(np.where(np.asarray(mask) > 0, d, 0.0), axis=1)


def sequence_ess(log_ratio) -> float:
  """Normalised effective sample size (sum w)^2 / (n sum w^2) of weights w = exp(log_ratio),
  in (0, 1]: 1 when every row weighs the same, 1/n when one row takes all the weight.
  Computed from the log-ratios (shifted by their max), so large ones do not overflow."""
  lr = np.asarray(log_ratio, np.float64).ravel()
  if lr.size == 0 or not np.all(np.isfinite(lr)):
    raise ValueError("sequence_ess: needs at least one finite log-ratio")
  w = np.exp(lr - lr.max())
  return float(w.sum() ** 2 / (lr.size * np.sum(w * w)))
