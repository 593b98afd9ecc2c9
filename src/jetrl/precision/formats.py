"""FP8 formats: names, dtypes and their largest finite values."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

# Public format names -> dtype. Unknown names are an error, never a default.
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_max(dtype) -> float:
  """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
  dtype = np.dtype(dtype)
  if dtype not in (np.dtype(E4M3), np.dtype(E5M2)):
    raise ValueError(
      f"unsupported FP8 dtype {dtype}; accepted: float8_e4m3fn (E4M3), float8_e5m2 (E5M2)"
    )
  return float(ml_dtypes.finfo(dtype).max)


def format_dtype(name: str):
  """The dtype of a format name ('e4m3' or 'e5m2')."""
  try:
    return FORMATS[name]
  except KeyError:
    raise ValueError(f"unknown FP8 format {name!r}; accepted: {sorted(FORMATS)}") from None


COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_from_name(name: str):
  """The jnp dtype a `Precision.compute_dtype` name stands for ('float32' or 'bfloat16')."""
  try:
    return COMPUTE_DTYPES[name]
  except KeyError:
    raise ValueError(
      f"unknown compute dtype {name!r}; accepted: {sorted(COMPUTE_DTYPES)}"
    ) from None


def dot_precision(*operands):
  """The dot precision that keeps a float32 model exact and bf16 dots fast.

  HIGHEST when any operand is float32 (no TF32 on GPUs: a float32 model stays float32),
  DEFAULT otherwise: bf16 x bf16 products are exact in the float32 accumulator either way,
  and on a GPU HIGHEST turns a bf16 dot into a much slower float32 one.
  """
  import jax  # pylint: disable=import-outside-toplevel

  if any(np.dtype(getattr(o, "dtype", o)) == np.float32 for o in operands):
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT
