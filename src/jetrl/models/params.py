"""The parameter pytree: layout, initialisation and shape checks.

params = {
  "embed":      [V, D],
  "layers": {                       # stacked along a leading layer axis L
    "attn_norm": [L, D],
    "wq": [L, D, H*Dh], "wk": [L, D, Hkv*Dh], "wv": [L, D, Hkv*Dh], "wo": [L, H*Dh, D],
    "bq": [L, H*Dh], "bk": [L, Hkv*Dh], "bv": [L, Hkv*Dh],       # qkv_bias only
    "q_norm": [L, Dh], "k_norm": [L, Dh],                          # qk_norm only
    "mlp_norm": [L, D],
    "w_gate": [L, D, F], "w_up": [L, D, F], "w_down": [L, F, D],    # dense MLP
    "router": [L, D, E],                                            # mixture of experts:
    "experts_gate": [L, E, D, Fe], "experts_up": [L, E, D, Fe],     # E experts of width Fe
    "experts_down": [L, E, Fe, D],                                  # (instead of w_gate ...)
  },
  "final_norm": [D],
  "lm_head":    [D, V],             # untied embeddings only
}
Matrices are stored [in, out] (y = x @ w), i.e. transposed relative to torch nn.Linear.

`forward_cached` also takes "layers" as a tuple of L per-layer dicts (`unstack_layers`): a
decode loop slices the stacked weights once, outside the loop, instead of at every step; and
a rollout's LM_HEAD_GRID (the LM head on its exact-dot grids, `jet_exact` only; shaped like
"lm_head", or like "embed" when tied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetrl.models.config import ModelConfig

INIT_STD = 0.02
# The projection weights of a layer: every `linear` of the model, so every FP8 GEMM.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A mixture of experts' projections, stacked per expert: [E, in, out] a layer, each expert's
# slice an FP8 GEMM of its own (jetrl.models.moe). The router is not one: compute dtype.
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def param_shapes(config: ModelConfig) -> dict:
  """The nested dict of parameter shapes for `config` (same structure as the params)."""
  c = config
  L, D, F, V = c.n_layers, c.d_model, c.d_ff, c.vocab_size
  layers = {
    "attn_norm": (L, D),
    "wq": (L, D, c.q_dim),
    "wk": (L, D, c.kv_dim),
    "wv": (L, D, c.kv_dim),
    "wo": (L, c.q_dim, D),
    "mlp_norm": (L, D),
  }
  if c.moe:
    E, Fe = c.n_experts, c.moe_d_ff
    layers.update(
      router=(L, D, E),
      experts_gate=(L, E, D, Fe),
      experts_up=(L, E, D, Fe),
      experts_down=(L, E, Fe, D),
    )
  else:
    layers.update(w_gate=(L, D, F), w_up=(L, D, F), w_down=(L, F, D))
  if c.qkv_bias:
    layers.update(bq=(L, c.q_dim), bk=(L, c.kv_dim), bv=(L, c.kv_dim))
  if c.qk_norm:
    layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
  shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not c.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
  """Random params: N(0, 0.02) matrices and embeddings, unit norms, zero biases."""
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    shapes, is_leaf=lambda s: isinstance(s, tuple)
  )
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if name.endswith("norm"):
      leaves.append(jnp.ones(shape, dtype))
    elif name in ("bq", "bk", "bv"):
      leaves.append(jnp.zeros(shape, dtype))
    else:
      leaves.append((INIT_STD * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def unstack_layers(params) -> dict:
  """params with "layers" as a tuple of per-layer dicts (each stacked leaf sliced along L).

  Leaves that are pytrees themselves (a `QuantizedWeight`) are sliced leaf by leaf. Params
  whose layers are already a tuple come back unchanged.
  """
  layers = params["layers"]
  if isinstance(layers, tuple):
    return params
  n = jax.tree_util.tree_leaves(layers)[0].shape[0]
  return dict(
    params, layers=tuple(jax.tree_util.tree_map(lambda w, i=i: w[i], layers) for i in range(n))
  )


# A batch-invariant rollout's LM head weights on their grids (jetrl.models.rollout_weights).
LM_HEAD_GRID = "lm_head_grid"

# Projections a rollout may fuse (jetrl.models.rollout_weights): fused name -> parts.
FUSED_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def _fused_expectation(per_layer: dict, layer) -> dict:
  """Expected per-layer shapes, with fused projections where `layer` has them."""
  if not isinstance(layer, dict):
    return per_layer
  out = dict(per_layer)
  for fused, parts in FUSED_PROJECTIONS.items():
    if fused in layer:
      d = per_layer[parts[0]][0]
      out[fused] = (d, sum(per_layer[p][1] for p in parts))
      for p in parts:
        out.pop(p)
  return out


def check_params(params, config: ModelConfig, allow_unstacked: bool = False) -> None:
  """ValueError naming the first parameter that is missing, unexpected or mis-shaped.

  allow_unstacked: also accept "layers" as a tuple of n_layers per-layer dicts, with q / k / v
    and gate / up possibly fused (a rollout's weights, `rollout_weights`).
  """
  expected = param_shapes(config)
  if allow_unstacked and isinstance(params, dict) and isinstance(params.get("layers"), tuple):
    if len(params["layers"]) != config.n_layers:
      raise ValueError(
        f"params['layers'] is a tuple of {len(params['layers'])} layers, "
        f"expected {config.n_layers} for this ModelConfig"
      )
    per_layer = {k: v[1:] for k, v in expected["layers"].items()}
    expected = dict(
      expected,
      layers={
        i: _fused_expectation(per_layer, params["layers"][i]) for i in range(config.n_layers)
      },
    )
    params = dict(params, layers=dict(enumerate(params["layers"])))
    if LM_HEAD_GRID in params:
      expected[LM_HEAD_GRID] = expected["embed" if config.tie_embeddings else "lm_head"]

  def walk(exp, got, prefix):
    if not isinstance(got, dict):
      raise ValueError(f"params{prefix} must be a dict, got {type(got).__name__}")
    missing = sorted(set(exp) - set(got))
    extra = sorted(set(got) - set(exp))
    if missing:
      raise ValueError(f"params{prefix} is missing {missing} (expected for this ModelConfig)")
    if extra:
      raise ValueError(f"params{prefix} has unexpected entries {extra} for this ModelConfig")
    for name, shape in exp.items():
      if isinstance(shape, dict):
        walk(shape, got[name], f"{prefix}[{name!r}]")
      elif tuple(got[name].shape) != shape:
        raise ValueError(
          f"params{prefix}[{name!r}] has shape {tuple(got[name].shape)}, "
          f"expected {shape} for this ModelConfig"
        )

  walk(expected, params, "")
