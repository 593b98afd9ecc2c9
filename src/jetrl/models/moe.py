"""A mixture-of-experts MLP (Qwen3-MoE): a top-k softmax router and SwiGLU experts.

For the normed residual stream h [..., D] of a layer whose params hold "router" [D, E] and
the experts' weights "experts_gate" / "experts_up" [E, D, Fe], "experts_down" [E, Fe, D]:

  p       = softmax(h @ router)                 float32, the router's dot in the compute dtype
  idx, v  = top_k(p, k)                         the k best experts, best first (ties: lower index)
  v       = v / sum(v)                          with norm_topk_prob
  y       = sum over experts e (in order) of    w_e * down_e(silu(gate_e(x_e)) * up_e(x_e))

where w_e is the token's weight for e (v in the cd, 0 when e is not among its k) and x_e is h
on the tokens routed to e and 0 on the others. The sum runs in float32, expert by expert, and
is cast to the compute dtype at the end.

Numerics (docs/numerics.md, "Mixture of experts"): the router is not quantized (the plan's
`router`: compute-dtype dot, float32 softmax; exact under the batch-invariant plan, like the
LM head); every expert projection is a `linear` of its own under the precision, so its weight
is quantized in 128x128 blocks per expert and x_e in 1x128 groups per token: a token's FP8
values do not depend on which other tokens visit its expert. A token not routed to e is a zero
row there (its groups quantize to 0 and add nothing), so the 128x1 groups of an expert's
weight gradient hold only the tokens routed to it.

Dispatch: every expert runs over all N tokens of the call (the non-routed ones as zero rows),
one `linear` per expert projection, in a `lax.scan` over the experts. Shapes are static and
nothing is dropped (dropless), and the rollout's decode steps and the training forward run
this same code, so a token's routing and its experts' values are computed the same way in
both. It costs E / k times the FLOPs of grouping each expert's tokens (sort-and-segment); a
capacity factor would bound that but make a token's output depend on the other tokens of the
batch (which ones overflow), breaking batch invariance, so it is not offered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetrl.models.config import ModelConfig
from jetrl.models.layers import Under, project
from jetrl.kernels.plan import plan_for


class Routing(NamedTuple):
  """One layer's routing of N tokens (leading axes [...] as the tokens')."""

  probs: jax.Array  # [..., E] float32: the router's softmax
  experts: jax.Array  # [..., k] int32: the k chosen experts, best first


def route(h: jax.Array, router_w, config: ModelConfig, plan: Under, cd):
  """(Routing, combine weights [..., k] in cd) of normed hidden states h [..., D]."""
  plan = plan_for(plan)
  _, probs = plan.router(h, router_w, cd)
  top, experts = jax.lax.top_k(probs, config.experts_per_token)
  if config.norm_topk_prob:
    total = top[..., 0]
    for j in range(1, top.shape[-1]):  # in slot order, elementwise: no batch-dependent sum
      total = total + top[..., j]
    top = top / total[..., None]
  return Routing(probs, experts.astype(jnp.int32)), top.astype(cd)


def moe_mlp(h: jax.Array, layer, config: ModelConfig, plan: Under, cd):
  """(y [..., D] in cd, Routing) of the layer's mixture of experts over h [..., D]."""
  plan = plan_for(plan)
  routing, weights = route(h, layer["router"], config, plan, cd)
  lead, d, e = h.shape[:-1], h.shape[-1], config.n_experts
  h2 = h.reshape(-1, d)
  experts = routing.experts.reshape(-1, config.experts_per_token)
  hit = experts[..., None] == jnp.arange(e, dtype=jnp.int32)  # [N, k, E]
  routed = jnp.any(hit, axis=1).T  # [E, N]
  # Each token's weight per expert (at most one of its k slots is that expert): [E, N].
  zero = jnp.zeros((), weights.dtype)
  per_expert = jnp.sum(jnp.where(hit, weights.reshape(-1, hit.shape[1], 1), zero), axis=1).T

  def expert(acc, xs):
    wg, wu, wd, we, sel = xs
    x = jnp.where(sel[:, None], h2, jnp.zeros((), h2.dtype))
    gate = project(x, wg, plan, cd)
    up = project(x, wu, plan, cd)
    y = project(jax.nn.silu(gate) * up, wd, plan, cd)
    return acc + (y * we[:, None]).astype(jnp.float32), None

  xs = (layer["experts_gate"], layer["experts_up"], layer["experts_down"], per_expert, routed)
  acc, _ = jax.lax.scan(expert, jnp.zeros(h2.shape, jnp.float32), xs)
  return acc.astype(cd).reshape(*lead, d), routing
