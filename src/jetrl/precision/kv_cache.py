"""The FP8 KV cache's numerics (`Precision.kv_cache == "fp8"`; docs/numerics.md, "FP8 KV cache").

Keys (after RoPE) and values [..., Dh] are quantized with `quantize` itself, the activations'
quantizer: per token and kv head, in E4M3, in 1 x KV_BLOCK groups along the head dimension
(one group of Dh for Dh <= 128; for a head size that is not a multiple of 128 the last group
is the remainder, e.g. 128 + 64 for Dh = 192), scale = amax / 448. Attention reads them
dequantized and rounded to the compute dtype:

  k' = cd(float32(q) * scale)

which is what a rollout's cache hands its attention (`dequantize_kv` of the stored FP8 values
and scales) and what the training forward's attention reads (`round_kv`, the same two
functions on the same values). In the training forward the rounding is passed straight
through: d loss / d k = d loss / d k' (`round_kv`'s custom VJP).
"""

from __future__ import annotations

import jax

from jetrl.precision.formats import E4M3
from jetrl.precision.quantize import dequantize, quantize, scale_shape

KV_BLOCK = 128  # the groups along the head dimension
KV_DTYPE = E4M3


def kv_block(ndim: int) -> tuple[int, ...]:
  """The tile of an [..., Dh] key or value array: one token and kv head, KV_BLOCK along Dh."""
  return (1,) * (ndim - 1) + (KV_BLOCK,)


def kv_scale_shape(shape) -> tuple[int, ...]:
  """The scales' shape of keys or values of `shape` [..., Dh]: [..., ceil(Dh / KV_BLOCK)]."""
  return scale_shape(shape, kv_block(len(shape)))


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(q, scale): x [..., Dh] in E4M3 and its float32 scales [..., ceil(Dh / KV_BLOCK)]."""
  return quantize(x, kv_block(x.ndim), KV_DTYPE)


def dequantize_kv(q: jax.Array, scale: jax.Array, cd) -> jax.Array:
  """The values attention reads from FP8 keys or values q and their scales: q * scale in
  float32, rounded to the compute dtype cd."""
  return dequantize(q, scale, kv_block(q.ndim)).astype(cd)


@jax.custom_vjp
def round_kv(x: jax.Array) -> jax.Array:
  """x [..., Dh] as an FP8 KV cache gives it back: `dequantize_kv(*quantize_kv(x), x.dtype)`.
  Its gradient is the identity (straight through the rounding)."""
  return dequantize_kv(*quantize_kv(x), x.dtype)


def _round_fwd(x):
  return round_kv(x), None


def _round_bwd(_, g):
  return (g,)


round_kv.defvjp(_round_fwd, _round_bwd)
