"""What the kernels are chosen for: the device a program is traced for (`Device`) and the
kernel settings a run may change (`KernelConfig`), read once when a `Plan` is resolved.

Each setting was an environment variable; they are fields now, and the variables are read
here alone (`KernelConfig.from_env`), as the defaults of a config that names none:

  field               variable                 default
  gemm_backend        JETRL_GEMM_BACKEND       "auto": what an Fp8Gemm's "auto" resolves to
  fused_quant         JETRL_FUSED_QUANT        None: the one-pass quantization on for a GPU
  fused_mlp           JETRL_FUSED_MLP          True: the fused MLP and norms where they apply
  decode_gemm         JETRL_DECODE_GEMM        "cublaslt" (or "pallas": the decode kernel)
  exact_cpu_kernel    JETRL_EXACT_CPU_KERNEL   True: jet_exact's CPU kernels where usable
  cublaslt_graphs     JETRL_CUBLASLT_GRAPHS    True: the cuBLASLt call inside XLA's graphs

(JETRL_EXACT_CPU_THREADS is read by the CPU kernels' library itself, per call: a thread
count, which no result depends on.)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import jax

from jetrl.precision import target as _target
from jetrl.precision.recipes import check_backend

DECODE_GEMMS = ("cublaslt", "pallas")


def _flag(environ: Mapping[str, str], name: str) -> Optional[bool]:
  """A 0 / 1 variable as a bool (None when unset or empty)."""
  value = environ.get(name, "").strip()
  if value not in ("", "0", "1"):
    raise ValueError(f"{name} must be 0, 1 or unset (the default), got {value!r}")
  return None if not value else value == "1"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which kernels run where several compute the same numbers (static, hashable)."""

  gemm_backend: str = "auto"
  fused_quant: Optional[bool] = None
  fused_mlp: bool = True
  decode_gemm: str = "cublaslt"
  exact_cpu_kernel: bool = True
  cublaslt_graphs: bool = True

  def __post_init__(self):
    check_backend(self.gemm_backend, "KernelConfig.gemm_backend")
    if self.decode_gemm not in DECODE_GEMMS:
      raise ValueError(
        f"KernelConfig.decode_gemm must be one of {list(DECODE_GEMMS)}, got {self.decode_gemm!r}"
      )

  @classmethod
  def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "KernelConfig":
    """The config the environment variables say (the module doc's table); unset: defaults."""
    env = os.environ if environ is None else environ
    backend = env.get("JETRL_GEMM_BACKEND", "").strip().lower() or "auto"
    check_backend(backend, "JETRL_GEMM_BACKEND value")
    decode = env.get("JETRL_DECODE_GEMM", "").strip() or "cublaslt"
    if decode not in DECODE_GEMMS:
      raise ValueError(
        f"JETRL_DECODE_GEMM must be one of {list(DECODE_GEMMS)} or unset, got {decode!r}"
      )
    fused_mlp = _flag(env, "JETRL_FUSED_MLP")
    return cls(
      gemm_backend=backend,
      fused_quant=_flag(env, "JETRL_FUSED_QUANT"),
      fused_mlp=True if fused_mlp is None else fused_mlp,
      decode_gemm=decode,
      exact_cpu_kernel=env.get("JETRL_EXACT_CPU_KERNEL", "1") != "0",
      cublaslt_graphs=env.get("JETRL_CUBLASLT_GRAPHS", "1") != "0",
    )


@dataclasses.dataclass(frozen=True)
class Device:
  """The device a program is traced for, and the kernel settings it is traced with.

  platform: JAX's platform name ("cpu", "gpu", "tpu"); compute_capability: an NVIDIA GPU's
  ("9.0"), None elsewhere or for this machine's own device (read from it where needed);
  interpret: a GPU program run here, its Pallas kernels interpreted and its FP8 GEMMs on XLA;
  memory_bytes: the device's memory (0: unknown); compiling: a compile-only target
  (`jetrl.aot`), not this machine's device."""

  platform: str
  compute_capability: Optional[str] = None
  interpret: bool = False
  memory_bytes: int = 0
  compiling: bool = False
  kernels: KernelConfig = KernelConfig()

  @property
  def gpu(self) -> bool:
    """Whether the program is compiled for a GPU (the Pallas kernels lowered for Triton, unless
    `interpret`)."""
    return self.platform == "gpu"

  @property
  def interpret_kernels(self) -> bool:
    """The Pallas kernels run interpreted: off a GPU (the CPU tests), or a GPU program run here."""
    return not self.gpu or self.interpret

  @property
  def fused_quant(self) -> bool:
    """Whether the cuBLASLt backend quantizes with the one-pass Pallas kernel (the config's
    `fused_quant`; unset: on in programs compiled for a GPU)."""
    setting = self.kernels.fused_quant
    return self.gpu if setting is None else setting


def current_device(kernels: Optional[KernelConfig] = None) -> Device:
  """The device programs traced now are for: a compile-only target while `jetrl.aot` compiles
  for one (jetrl.precision.target), else JAX's default backend; with `kernels`, or the
  environment's settings (`KernelConfig.from_env`)."""
  kernels = KernelConfig.from_env() if kernels is None else kernels
  t = _target.compile_target()
  if t is not None:
    return Device(
      t.platform, t.compute_capability, t.interpret, t.memory_bytes, compiling=True, kernels=kernels
    )
  return Device(jax.default_backend(), kernels=kernels)
