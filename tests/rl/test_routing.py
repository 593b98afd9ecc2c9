"""Routing agreement of a mixture of experts (jetrl.rl.routing) against hand values."""

import jax.numpy as jnp
import numpy as np

from jetrl.models import Routing
from jetrl.rl.routing import route_metrics, route_sums


def test_route_sums_by_hand():
  """One row, 4 completion tokens (3 fed back), 2 layers, 4 experts, top 2. The training
  forward's probabilities put the experts in the order of `order` at each (token, layer)."""
  order = [  # training order of the 4 experts, best first: [token][layer]
    [[0, 1, 2, 3], [3, 2, 1, 0]],
    [[1, 0, 2, 3], [2, 3, 0, 1]],
    [[0, 1, 2, 3], [0, 1, 2, 3]],
  ]
  probs = np.zeros((1, 5, 2, 4), np.float32)  # S = P + T - 1 = 2 + 4 - 1 input positions
  experts = np.zeros((1, 5, 2, 2), np.int32)
  for t, layers in enumerate(order):
    for layer, o in enumerate(layers):
      probs[0, 2 + t, layer, o] = [0.4, 0.3, 0.2, 0.1]
      experts[0, 2 + t, layer] = o[:2]
  rollout = np.array(
    [[[[0, 1], [3, 2]], [[0, 1], [2, 0]], [[2, 3], [0, 1]], [[0, 0], [0, 0]]]], np.int32
  )
  # token 0: both layers the same set (and order): shift 0.
  # token 1: layer 0 {0, 1} = {1, 0}, ranks 1 and 0 vs slots 0 and 1: shift 1 + 1;
  #          layer 1 {2, 0} vs {2, 3}: differs; 2 at rank 0 (slot 0), 0 at rank 2 (slot 1): 1.
  # token 2: masked out (mask 0), token 3: never fed back (the last).
  mask = np.array([[1, 1, 0, 1]], np.float32)
  sums = route_sums(jnp.asarray(rollout), Routing(jnp.asarray(probs), jnp.asarray(experts)), mask)
  got = {k: float(v) for k, v in sums.items()}
  assert got == {"route_n": 2.0, "route_same": 1.0, "route_same_layer": 1.5, "route_shift": 0.75}
  m = {k: float(v) for k, v in route_metrics(sums).items()}
  assert m == {"route_agree": 0.5, "route_agree_layer": 0.75, "route_rank_shift": 0.375}


def test_ties_rank_the_lower_index_first_and_no_tokens_is_perfect():
  probs = np.full((1, 2, 1, 3), 1 / 3, np.float32)
  experts = np.array([[[[0]], [[0]]]], np.int32)
  rollout = np.array([[[[1]], [[0]]]], np.int32)  # [R, T=2, L, k]: token 0 fed back
  sums = route_sums(
    jnp.asarray(rollout), Routing(jnp.asarray(probs), jnp.asarray(experts)), np.ones((1, 2))
  )
  assert float(sums["route_same"]) == 0.0 and float(sums["route_shift"]) == 1.0  # 1 ranks 1st
  empty = route_sums(
    jnp.asarray(rollout), Routing(jnp.asarray(probs), jnp.asarray(experts)), np.zeros((1, 2))
  )
  m = {k: float(v) for k, v in route_metrics(empty).items()}
  assert m == {"route_agree": 1.0, "route_agree_layer": 1.0, "route_rank_shift": 0.0}
