"""Whether the update recomputes each layer in its backward pass (rematerialisation).

Per-layer remat trades a second forward for not storing every layer's activations. It pays
only when those activations would take a large share of the device's memory; on the CPU demo
and the tests it would only cost time. `resolve_remat("auto", ...)` decides from an estimate.
"""

from __future__ import annotations

import jax

REMAT_POLICIES = ("auto", "none", "layer")

# Fraction of device memory the stored activations of one micro-batch may take before "auto"
# turns on per-layer rematerialisation (the params, gradients, optimizer state and the
# temporaries take the rest).
REMAT_MEMORY_FRACTION = 0.25


def activation_bytes(model_config, rows: int, seq_len: int, flash: bool = False) -> int:
  """Rough bytes of the activations a backward pass keeps for `rows` x `seq_len` tokens
  without rematerialisation: per layer and token, the bf16 inputs of every projection and
  norm, the MLP's hidden activations, and the float32 + bf16 attention probabilities (flash:
  the attention kernel keeps none, only its float32 softmax statistics)."""
  c = model_config
  q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  per_token = 2 * (6 * c.d_model + 2 * q + 2 * kv + 5 * c.d_ff)
  per_token += 8 * c.n_heads if flash else 6 * c.n_heads * seq_len
  return int(rows * seq_len * c.n_layers * per_token)


def device_memory_bytes(known: int = 0) -> int:
  """The device's memory: `known` where it is given (a plan's device, `Device.memory_bytes`:
  a compile target's, jetrl.aot), else this machine's default device's limit (16 GiB where
  the backend does not say)."""
  if known:
    return int(known)
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  return int(stats.get("bytes_limit", 16 << 30))


def resolve_remat(
  policy: str,
  model_config,
  rows: int,
  seq_len: int,
  flash: bool = False,
  memory_bytes: int = 0,
) -> bool:
  """Whether the update recomputes each layer in the backward pass.

  "auto": yes when one micro-batch's activations (`activation_bytes`) would take more than
  REMAT_MEMORY_FRACTION of the device's memory (a 1.5B model at 16 x 1024 tokens on an H200,
  for one), no for small models and batches (the
  tests, the CPU demo), where recomputing only costs time. flash: the forward attends with
  the flash-attention kernel (`attention.use_flash`), which stores no probabilities.
  memory_bytes: the device's memory where the plan's device says it (0: ask this machine's).
  """
  if policy != "auto":
    return policy == "layer"
  need = activation_bytes(model_config, rows, seq_len, flash)
  return need > REMAT_MEMORY_FRACTION * device_memory_bytes(memory_bytes)
