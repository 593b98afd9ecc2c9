"""Which implementation runs an FP8 GEMM: XLA, or the blockwise FP8 Pallas kernel.

Each `Fp8Gemm` carries a `gemm_backend` field (static under jit, like the rest of a recipe):

  "auto"              the Pallas kernel on an FP8-capable GPU (NVIDIA, compute capability
                      >= 8.9: Ada, Hopper and later), the XLA path everywhere else
  "xla"               quantize, dequantize to float32, one float32 matmul (the CPU emulation;
                      the reference the kernel is tested against)
  "pallas"            the Pallas kernel compiled for the GPU (Triton): FP8 operands into the dot
  "pallas_interpret"  the same kernel in Pallas interpret mode (runs anywhere, slowly; tests)

The environment variable JETRL_GEMM_BACKEND ("xla", "pallas", "pallas_interpret" or "auto")
overrides what "auto" resolves to, for a whole process; an explicit field value always wins.
It is read once, on the first FP8 GEMM traced. `with_gemm_backend(recipe_or_precision, name)`
returns a copy whose every FP8 GEMM uses `name`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

GEMM_BACKENDS = ("auto", "xla", "pallas", "pallas_interpret")
ENV_VAR = "JETRL_GEMM_BACKEND"
# FP8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) and later.
MIN_COMPUTE_CAPABILITY = (8, 9)


def check_backend(name: str, what: str = "gemm_backend") -> str:
  """`name` if it is one of GEMM_BACKENDS, else a ValueError listing them."""
  if name not in GEMM_BACKENDS:
    raise ValueError(f"unknown {what} {name!r}; accepted: {list(GEMM_BACKENDS)}")
  return name


@functools.lru_cache(maxsize=None)
def env_backend() -> Optional[str]:
  """The JETRL_GEMM_BACKEND override (None when unset, empty or "auto"); read once."""
  value = os.environ.get(ENV_VAR, "").strip().lower()
  if not value or value == "auto":
    return None
  return check_backend(value, f"{ENV_VAR} value")


def _parse_cc(cc) -> tuple[int, ...]:
  try:
    return tuple(int(p) for p in str(cc).split("."))
  except ValueError:
    return (0,)


@functools.lru_cache(maxsize=None)
def fp8_gpu_available() -> bool:
  """True when JAX's default device is an NVIDIA GPU with FP8 tensor cores (cc >= 8.9)."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    if jax.default_backend() != "gpu":
      return False
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  # NVIDIA devices report "major.minor"; ROCm ones a gfx name, which parses as (0,).
  return _parse_cc(getattr(dev, "compute_capability", "0")) >= MIN_COMPUTE_CAPABILITY


def kernel_unsupported_reason(block: int) -> Optional[str]:
  """Why the Pallas kernel cannot serve a GEMM with this scaling block (None if it can).

  The kernel's contraction tile is the scaling block, and Triton tiles are powers of two with
  at least 16 entries (the smallest FP8 MMA step along K is 32, which Triton pads to).
  """
  if block < 16 or block & (block - 1):
    return f"block={block}: the Pallas kernel needs a power of two >= 16"
  return None


def resolve(gemm) -> str:
  """The concrete backend ("xla", "pallas" or "pallas_interpret") for an `Fp8Gemm`."""
  name = check_backend(gemm.gemm_backend)
  if name == "auto":
    name = env_backend() or ("pallas" if fp8_gpu_available() else "xla")
    if name != "xla" and kernel_unsupported_reason(gemm.block):
      return "xla"  # "auto" never fails: the XLA path computes the same numbers.
    return name
  if name != "xla":
    reason = kernel_unsupported_reason(gemm.block)
    if reason:
      raise ValueError(f"gemm_backend={name!r} cannot run this GEMM: {reason}; use "
                       "gemm_backend='xla' or 'auto'")
  return name


def with_gemm_backend(obj, name: str):
  """A copy of an Fp8Gemm, Precision or Recipe whose every FP8 GEMM uses backend `name`.

  A Recipe whose rollout is its training forward stays unified (the rollout is derived from
  the new training precision, sharing its fprop object).
  """
  # Imported here: recipes imports this module for GEMM_BACKENDS.
  from jetrl.precision.recipes import Fp8Gemm, Precision, Recipe  # pylint: disable=import-outside-toplevel
  check_backend(name)
  if obj is None:
    return None
  if isinstance(obj, Fp8Gemm):
    return dataclasses.replace(obj, gemm_backend=name)
  if isinstance(obj, Precision):
    # One replaced object per distinct original, so shared GEMM settings stay shared.
    memo = {}
    def sub(g):
      if g is None:
        return None
      if id(g) not in memo:
        memo[id(g)] = dataclasses.replace(g, gemm_backend=name)
      return memo[id(g)]
    return dataclasses.replace(obj, fprop=sub(obj.fprop), dgrad=sub(obj.dgrad),
                               wgrad=sub(obj.wgrad))
  if isinstance(obj, Recipe):
    return dataclasses.replace(obj, train=with_gemm_backend(obj.train, name),
                               rollout_override=with_gemm_backend(obj.rollout_override, name))
  raise TypeError(f"with_gemm_backend: expected an Fp8Gemm, Precision or Recipe, got {type(obj)}")
