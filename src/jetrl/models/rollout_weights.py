"""Rollout-time weights: quantized once, sliced per layer once, projections fused.

A rollout decodes hundreds of steps with fixed weights; preparing them inside every step
repeats the same work. `rollout_weights` returns the params pytree a rollout reads:

  * every projection weight quantized once with the fprop's own quantizer, from the same
    stored values, so the rollout's FP8 weights are bit-identical to the training fprop's
    (`prequantize_linear_weights`; a `QuantizedWeight` in the layout the GEMM backend reads).
    A mixture of experts' expert weights [E, K, N] likewise, each expert in its own 128x128
    blocks (the expert axis leads like the layer axis; the router is not FP8);
  * with `fuse`, q / k / v fused into one "wqkv" [D, q + 2 kv] and gate / up into one
    "w_gate_up" [D, 2F] projection (two GEMMs per layer instead of five at every decode step).
    Under a blockwise FP8 recipe the weights are fused only where every part's output width is
    a multiple of the block, so that no BxB block straddles two parts: each part's FP8 values
    and scales are then exactly those of quantizing it alone;
  * the layers sliced once into a tuple (`unstack_layers`);
  * under a batch-invariant precision (`jet_exact`), "lm_head_grid": the LM head's weights
    with each vocabulary entry on its exact-dot grid (`Plan.head_grid`), which the
    exact LM head otherwise recomputes at every step. One compute-dtype copy of the LM head.
Everything else (norms, embeddings, biases) is left as it is. A LoRA run's params
(`jetrl.models.lora`) keep their adapters as they are and their frozen base, already quantized
once when the training precision is FP8, is not quantized again; its projections are not fused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from jetrl.kernels.plan import Plan, plan_for
from jetrl.models.layers import activation_dtype, fusable
from jetrl.models.lora import LoraWeight
from jetrl.models.params import (
  EXPERT_WEIGHTS,
  FUSED_PROJECTIONS,
  LINEAR_WEIGHTS,
  LM_HEAD_GRID,
  unstack_layers,
)
from jetrl.precision import Precision, QuantizedWeight, prequantize_weight


def prequantize_linear_weights(params, precision: Optional[Precision], plan: Optional[Plan] = None):
  """params with FP8 projection weights for `precision`, in the layout the GEMMs of `plan`
  read (default: the plan resolved for it now); unchanged if it has no FP8 fprop."""
  if precision is None or precision.fprop is None:
    return params
  g = precision.fprop
  # Scales padded once as the GEMM kernel reads them (a rollout's weights serve only fprop).
  plan = plan_for(precision, plan)
  quant = lambda w: plan.with_gemm_scales(
    prequantize_weight(w, g, k_major=plan.k_major(g, False)), g
  )
  layers = dict(params["layers"])
  for name in LINEAR_WEIGHTS + tuple(FUSED_PROJECTIONS) + EXPERT_WEIGHTS:
    w = layers.get(name)
    if w is None or isinstance(w, QuantizedWeight):  # absent, or frozen and quantized once
      continue
    if isinstance(w, LoraWeight):  # the frozen base quantized, the adapters as they are
      if not isinstance(w.base, QuantizedWeight):
        layers[name] = dataclasses.replace(w, base=quant(w.base))
    else:
      layers[name] = quant(w)
  return dict(params, layers=layers)


def fuse_projections(params, precision: Optional[Precision]):
  """params with q / k / v and gate / up fused where the precision allows (see module doc)."""
  layers = dict(params["layers"])
  for fused, parts in FUSED_PROJECTIONS.items():
    if fusable(layers, parts, precision):
      layers[fused] = jnp.concatenate([layers.pop(p) for p in parts], axis=-1)
  return dict(params, layers=layers)


def rollout_weights(
  params, precision: Optional[Precision], *, fuse: bool = True, plan: Optional[Plan] = None
):
  """The params a rollout reads (see the module doc), for the kernels of `plan` (default: the
  plan resolved for `precision` now; the sampler passes its own)."""
  plan = plan_for(precision, plan)
  if fuse:
    params = fuse_projections(params, precision)
  params = with_head_grid(params, precision, plan)
  return unstack_layers(prequantize_linear_weights(params, precision, plan))


def with_head_grid(params, precision: Optional[Precision], plan: Optional[Plan] = None):
  """params with LM_HEAD_GRID where the plan's head reads its weights on a grid
  (`Plan.head_grid`: the exact LM head's, tied: from "embed"), else unchanged."""
  tied = "lm_head" not in params
  w = params["embed"] if tied else params["lm_head"]
  grid = plan_for(precision, plan).head_grid(w, tied, activation_dtype(precision, params))
  return params if grid is None else dict(params, **{LM_HEAD_GRID: grid})
