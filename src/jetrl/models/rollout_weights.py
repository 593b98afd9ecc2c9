"""Rollout-time weights: every projection's weight quantized once, with the fprop's quantizer.

A rollout decodes hundreds of steps with fixed weights; quantizing them inside every step
repeats the same work. `prequantize_linear_weights` returns the params pytree with each
projection weight replaced by a `QuantizedWeight` computed by the very function the training
forward uses, from the same stored values, so the rollout's FP8 weights are bit-identical to
the training fprop's. Everything else (norms, embeddings, biases) is left as it is.
"""

from __future__ import annotations

from typing import Optional

from jetrl.precision import Precision, prequantize_weight
from jetrl.precision.backend import wants_k_major

LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def prequantize_linear_weights(params, precision: Optional[Precision]):
  """params with FP8 projection weights for `precision`; unchanged if it has no FP8 fprop."""
  if precision is None or precision.fprop is None:
    return params
  layers = dict(params["layers"])
  for name in LINEAR_WEIGHTS:
    layers[name] = prequantize_weight(layers[name], precision.fprop,
                                      k_major=wants_k_major(precision.fprop))
  return dict(params, layers=layers)
