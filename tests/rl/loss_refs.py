"""Shared by the policy-loss tests: one jitted value-and-gradient entry point for any loss of
`jetrl.rl.losses` / `jetrl.rl.ratio_losses`, a float64 aggregation and a hand-made batch."""

import functools

import jax
import numpy as np

from jetrl.rl import losses


@functools.partial(jax.jit, static_argnames=("loss_fn", "options"))
def _value_and_grad(loss_fn, logp, old_logp, adv, mask, is_weights, options):
  def f(lp):
    num, den, metrics = loss_fn(lp, old_logp, adv, mask, is_weights=is_weights, **dict(options))
    return losses.finalize_loss(num, den), (num, den, metrics)

  (loss, (num, den, metrics)), g = jax.value_and_grad(f, has_aux=True)(logp)
  return loss, num, den, metrics, g


def policy_value_and_grad(loss_fn, logp, old_logp, adv, mask, is_weights=None, **kw):
  """(loss, num, den, metrics, d loss / d logp) of `loss_fn`; `kw`, its static keywords."""
  return _value_and_grad(loss_fn, logp, old_logp, adv, mask, is_weights, tuple(sorted(kw.items())))


def np_aggregate(per_token, mask, aggregation, max_tokens=None):
  """(num, den, d num / d per_token) in float64."""
  m = mask.astype(np.float64)
  x = np.where(mask, per_token, 0.0)
  if aggregation == "token":
    return x.sum(), m.sum(), m
  if aggregation == "seq_mean_token_mean":
    n = m.sum(axis=1)
    safe = np.maximum(n, 1.0)
    return (x.sum(axis=1) / safe).sum(), float((n > 0).sum()), m / safe[:, None]
  b, t = per_token.shape
  return x.sum(), float(b * (t if max_tokens is None else max_tokens)), m


def hand_batch():
  """B=4, T=5: a normal row, an all-masked row, a single-token row, extreme gaps (+-50)."""
  logp = np.array(
    [
      [-1.0, -0.5, -2.0, -0.1, -3.0],
      [-1.0, -1.0, -1.0, -1.0, -1.0],  # all masked
      [-0.7, 9.0, 9.0, 9.0, 9.0],  # single token
      [-50.0, 0.0, -60.0, -5.0, -1.0],  # extreme gaps
    ],
    np.float32,
  )
  old = np.array(
    [
      [-1.3, -0.3, -1.5, -0.1, -2.0],
      [-2.0, -2.0, -2.0, -2.0, -2.0],
      [-0.2, 0.0, 0.0, 0.0, 0.0],
      [0.0, -50.0, -10.0, -5.2, -0.9],
    ],
    np.float32,
  )
  mask = np.array(
    [
      [1, 1, 1, 1, 0],
      [0, 0, 0, 0, 0],
      [1, 0, 0, 0, 0],
      [1, 1, 1, 1, 1],
    ],
    bool,
  )
  return logp, old, mask
