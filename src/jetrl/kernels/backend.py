"""Which implementation runs an FP8 GEMM: cuBLASLt, the Pallas kernel, or XLA.

Each `Fp8Gemm` carries a `gemm_backend` field (static under jit, like the rest of a recipe):

  "auto"              on Hopper, cuBLASLt's blockwise FP8 GEMM (jetrl.kernels.cublaslt);
                      on another FP8-capable NVIDIA GPU (compute capability >= 8.9), or when
                      cuBLASLt cannot serve, the Pallas kernel; XLA everywhere else
  "xla"               quantize, dequantize to float32, one float32 matmul (the CPU emulation;
                      the reference the kernels are tested against)
  "cublaslt"          cuBLASLt's FP8 GEMM with 1x128 / 128x128 scales (Hopper)
  "pallas"            the Pallas kernel compiled for the GPU (Triton): FP8 operands into the dot
  "pallas_interpret"  the same kernel in Pallas interpret mode (runs anywhere, slowly; tests)

A run's `--kernels.gemm_backend` (`KernelConfig.gemm_backend`, jetrl.kernels.device; default
from JETRL_GEMM_BACKEND) says what "auto" resolves to; an explicit field value always wins. `jetrl.precision.with_gemm_backend(recipe, name)` returns a copy of a
recipe whose every FP8 GEMM uses `name`.

A GEMM that the chosen kernel cannot take (a block size other than 128 for cuBLASLt, a shape
cuBLASLt has no algorithm for) runs on the next one down (cuBLASLt -> Pallas -> XLA): the FP8
values and scales are the same on every backend, only the summation order differs. "auto"
logs each fallback once, with the reason.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from jetrl.kernels import cublaslt
from jetrl.kernels.device import Device, current_device
from jetrl.precision.recipes import GEMM_BACKENDS, check_backend  # noqa: F401 (re-exported)

KERNELS = ("cublaslt", "pallas", "pallas_interpret")
# FP8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) and later.
MIN_COMPUTE_CAPABILITY = (8, 9)

log = logging.getLogger("jetrl")


def _parse_cc(cc) -> tuple[int, ...]:
  try:
    return tuple(int(p) for p in str(cc).split("."))
  except ValueError:
    return (0,)


@functools.lru_cache(maxsize=None)
def _local_fp8_gpu() -> bool:
  """Whether JAX's default device is an NVIDIA GPU with FP8 tensor cores (read once)."""
  import jax  # pylint: disable=import-outside-toplevel

  try:
    if jax.default_backend() != "gpu":
      return False
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  # NVIDIA devices report "major.minor"; ROCm ones a gfx name, which parses as (0,).
  return _parse_cc(getattr(dev, "compute_capability", "0")) >= MIN_COMPUTE_CAPABILITY


def fp8_gpu_available(dev: Optional[Device] = None) -> bool:
  """True when the programs traced for `dev` (default: `current_device()`) run on an NVIDIA
  GPU with FP8 tensor cores (cc >= 8.9): a compile target's, or JAX's default device (read
  once)."""
  dev = current_device() if dev is None else dev
  if dev.interpret:  # a GPU program run here, interpreted
    return False
  if dev.compiling:  # a device compiled for from a machine without it (jetrl.aot)
    cc = dev.compute_capability or "0"
    return dev.platform == "gpu" and _parse_cc(cc) >= MIN_COMPUTE_CAPABILITY
  return _local_fp8_gpu()


def kernel_unsupported_reason(block: int) -> Optional[str]:
  """Why the Pallas kernel cannot serve a GEMM with this scaling block (None if it can).

  The kernel's contraction tile is the scaling block, and Triton tiles are powers of two with
  at least 16 entries (the smallest FP8 MMA step along K is 32, which Triton pads to).
  """
  if block < 16 or block & (block - 1):
    return f"block={block}: the Pallas kernel needs a power of two >= 16"
  return None


def cublaslt_unsupported_reason(gemm, dev: Optional[Device] = None) -> Optional[str]:
  """Why cuBLASLt cannot serve this Fp8Gemm at all (None if it can, shape permitting)."""
  if gemm.scaling == "block" and gemm.block != 128:
    return f"block={gemm.block}: cuBLASLt scales 1x128 / 128x128 blocks only"
  return cublaslt.unavailable_reason(_graphs(dev))


def _graphs(dev: Optional[Device]) -> Optional[bool]:
  """The CUDA-graph setting the cuBLASLt handler is registered with (None: the environment's)."""
  return None if dev is None else dev.kernels.cublaslt_graphs


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
  log.warning("jetrl: %s", message)


def _auto(dev: Device) -> str:
  if not fp8_gpu_available(dev):
    return "xla"
  reason = cublaslt.unavailable_reason(_graphs(dev))
  if reason is None:
    return "cublaslt"
  _say_once(f"the cuBLASLt FP8 GEMM is unavailable ({reason}); FP8 GEMMs use the Pallas kernel")
  return "pallas"


def resolve(gemm, dev: Optional[Device] = None) -> str:
  """The concrete backend ("xla", "cublaslt", "pallas" or "pallas_interpret") of an Fp8Gemm.

  For "auto" this is the preferred kernel; a particular GEMM may still fall back
  (`fallback`). An explicit kernel that cannot run at all is a ValueError with the reason.
  """
  dev = current_device() if dev is None else dev
  name = check_backend(gemm.gemm_backend)
  explicit = name != "auto"
  if not explicit:
    name = dev.kernels.gemm_backend
    name = _auto(dev) if name == "auto" else name
  if name == "cublaslt":
    reason = cublaslt_unsupported_reason(gemm, dev)
    if reason and explicit:
      raise ValueError(
        f"gemm_backend='cublaslt' cannot run this GEMM: {reason}; use "
        "gemm_backend='pallas', 'xla' or 'auto'"
      )
    if reason:
      _say_once(f"cuBLASLt cannot serve these FP8 GEMMs ({reason}); using the next backend")
      name = "pallas" if fp8_gpu_available(dev) else "xla"
  if name in ("pallas", "pallas_interpret"):
    reason = kernel_unsupported_reason(gemm.block)
    if reason and explicit:
      raise ValueError(
        f"gemm_backend={name!r} cannot run this GEMM: {reason}; use gemm_backend='xla' or 'auto'"
      )
    if reason:
      return "xla"  # "auto" never fails: the XLA path computes the same numbers.
  return name


def fallback(name: str, gemm, dev: Optional[Device] = None) -> str:
  """The backend below `name` for one GEMM that `name` cannot take."""
  if name == "cublaslt" and fp8_gpu_available(dev) and not kernel_unsupported_reason(gemm.block):
    return "pallas"
  return "xla"


def wants_k_major(gemm, dev: Optional[Device] = None) -> bool:
  """Whether this GEMM's backend reads weights K-major (the FP8 kernels do; XLA does not)."""
  return resolve(gemm, dev) in KERNELS
