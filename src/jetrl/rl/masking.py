"""Masked token arithmetic shared by the losses, the corrections and the agreement metrics.

A [B, T] mask marks the completion tokens that count. Masked-out positions may hold anything
(padding, or a NaN the sampler never produced but a caller might pass): `masked` replaces them
with 0 by selection, never by multiplication, so a NaN outside the mask cannot leak into a sum,
while a NaN inside it stays visible.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

_F32 = jnp.float32


def as_mask(mask: chex.Array) -> chex.Array:
  """The mask as bool (it may come as 0/1 floats)."""
  return jnp.asarray(mask).astype(bool)


def masked(x: chex.Array, mask: chex.Array) -> chex.Array:
  """float32 `x` with the masked-out positions set to 0."""
  return jnp.where(mask, jnp.asarray(x).astype(_F32), _F32(0.0))


def masked_mean(x: chex.Array, mask: chex.Array) -> chex.Array:
  """Mean of `x` over the masked-in positions (0 when there are none), float32."""
  n = jnp.sum(mask, dtype=_F32)
  return jnp.sum(masked(x, mask)) / jnp.maximum(n, 1.0)
