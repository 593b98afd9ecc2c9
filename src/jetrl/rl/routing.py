"""A mixture of experts in the update: routing agreement and the load-balancing loss.

Routing agreement compares, for each completion token the rollout fed through the model (all
but the last), the experts its decode step chose in each layer (`Rollout.routes`) with those
the training forward chooses at the same position:

  route_agree        share of tokens whose top-k expert set is the same in every layer
  route_agree_layer  share of (token, layer) pairs whose top-k expert set is the same
  route_rank_shift   mean over (token, layer, rollout slot r) of |rank_train(e_r) - r|, where
                     e_r is the rollout's r-th best expert and rank_train(e) its place in the
                     training forward's order of all experts (0 best; ties: lower index first)

Perfect agreement is 1, 1, 0. Each is a ratio of sums (`route_sums`), so micro-batches add.

The load-balancing loss is `transformers`' `load_balancing_loss_func` (Switch Transformer,
eqs. 4-6), over every layer and every real input position (the attention mask):

  f_e = (tokens choosing e among their top k) / (L * positions)
  P_e = (sum of the router's probability of e) / (L * positions)
  aux = E * sum_e f_e * P_e          (its gradient through P only)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetrl.models.moe import Routing

ROUTE_SUMS = ("route_n", "route_same", "route_same_layer", "route_shift")
ROUTE_METRICS = ("route_agree", "route_agree_layer", "route_rank_shift")


def completion_routing(train: Routing, n_completion: int) -> Routing:
  """The training forward's routing [R, S, ...] of the completion tokens that are inputs:
  the last T - 1 positions ([R, T - 1, ...])."""
  s = train.experts.shape[1]
  return Routing(*(a[:, s - n_completion + 1 :] for a in train))


def route_sums(rollout_experts, train: Routing, mask) -> dict:
  """float32 sums of the routing agreement (`ROUTE_SUMS`) of a micro-batch: rollout_experts
  [R, T, L, k] (`TrainBatch.rollout_routes`), train the training forward's routing of the
  input positions [R, S, L, ...], mask [R, T] the completion tokens."""
  t = rollout_experts.shape[1]
  got = completion_routing(train, t)  # [R, T - 1, L, ...]
  want = rollout_experts[:, : t - 1].astype(jnp.int32)
  m = (mask[:, : t - 1] > 0).astype(jnp.float32)
  n_layers, k = want.shape[-2], want.shape[-1]
  same_layer = jnp.all(jnp.sort(want, -1) == jnp.sort(got.experts, -1), axis=-1)  # [R, T-1, L]
  same = jnp.all(same_layer, axis=-1)
  # Rank of each of the rollout's experts in the training forward's order of all experts.
  p = got.probs  # [R, T-1, L, E]
  pe = jnp.take_along_axis(p, want, axis=-1)  # [R, T-1, L, k]
  idx = jnp.arange(p.shape[-1], dtype=jnp.int32)
  above = (p[..., None, :] > pe[..., None]) | (
    (p[..., None, :] == pe[..., None]) & (idx < want[..., None])
  )
  rank = jnp.sum(above, axis=-1)
  shift = jnp.sum(jnp.abs(rank - jnp.arange(k)), axis=(-1, -2)).astype(jnp.float32)
  return dict(
    route_n=m.sum(),
    route_same=(same * m).sum(),
    route_same_layer=(same_layer.sum(-1) * m).sum() / n_layers,
    route_shift=(shift * m).sum() / (n_layers * k),
  )


def route_metrics(sums: dict) -> dict:
  """`ROUTE_METRICS` from summed `route_sums` (1, 1, 0 where no token was compared)."""
  n = sums["route_n"]
  safe = jnp.maximum(n, 1.0)
  has = n > 0
  return dict(
    route_agree=jnp.where(has, sums["route_same"] / safe, 1.0),
    route_agree_layer=jnp.where(has, sums["route_same_layer"] / safe, 1.0),
    route_rank_shift=jnp.where(has, sums["route_shift"] / safe, 0.0),
  )


def load_balancing_loss(routing: Routing, attention_mask) -> jax.Array:
  """The load-balancing loss (module doc) of routing [R, S, L, ...] over the real positions
  attention_mask [R, S]; a float32 scalar."""
  probs, experts = routing
  n_layers, n_experts = probs.shape[-2], probs.shape[-1]
  m = attention_mask.astype(jnp.float32)[..., None, None]  # [R, S, 1, 1]
  rows = jnp.maximum(m.sum() * n_layers, 1.0)
  chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32).sum(-2)  # [R, S, L, E]
  f = jax.lax.stop_gradient((chosen * m).sum((0, 1, 2)) / rows)
  prob = (probs.astype(jnp.float32) * m).sum((0, 1, 2)) / rows
  return n_experts * jnp.sum(f * prob)
