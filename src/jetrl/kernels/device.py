"""What the kernels are chosen for: the device a program is traced for (`Device`) and the
kernel settings a run may change (`KernelConfig`), fixed when a `Plan` is resolved.

`KernelConfig` is a node of a run's configuration (`--kernels.*`, recorded in its
config.json). Each setting was once an environment variable, which now only gives the
setting's default: the entry points (`jetrl.train.cli`, experiments/compile_report.py) read
the variables once, when the configuration is built (`kernel_defaults`), and say which
variable set what; a
program whose plan is resolved without a `KernelConfig` (a library call, the benchmarks)
takes the environment's too. `KernelConfig.from_env` is the one reader:

  flag                         variable                 default
  --kernels.gemm_backend       JETRL_GEMM_BACKEND       "auto": what an Fp8Gemm's "auto" resolves to
  --kernels.fused_quant        JETRL_FUSED_QUANT        none: the one-pass quantization on for a GPU
  --kernels.fused_mlp          JETRL_FUSED_MLP          true: the fused MLP and norms where they apply
  --kernels.decode_gemm        JETRL_DECODE_GEMM        "cublaslt" (or "pallas": the decode kernel)
  --kernels.exact_cpu_kernel   JETRL_EXACT_CPU_KERNEL   true: jet_exact's CPU kernels where usable
  --kernels.cublaslt_graphs    JETRL_CUBLASLT_GRAPHS    true: the cuBLASLt call inside XLA's graphs

(a variable is 0 or 1 for a true / false setting; JETRL_EXACT_CPU_THREADS is read by the CPU
kernels' library itself, per call: a thread count, which no result depends on.)

The device is an argument too, never a global: a `Plan` carries its `Device`, and what runs
under the plan (the FP8 GEMMs, the exact kernels, the sampler's draw, the update's
rematerialisation) is told it. `current_device` is the device a plan resolved without one is
for: this machine's default backend, or inside `jetrl.aot.tracing_for` (`tracing`) the
compile-only target's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Iterator, Mapping, Optional

import jax

from jetrl.config import check_fields, field, replace
from jetrl.precision.recipes import GEMM_BACKENDS

DECODE_GEMMS = ("cublaslt", "pallas")

# {field: the environment variable that gives its default}
ENV_VARIABLES = {
  "gemm_backend": "JETRL_GEMM_BACKEND",
  "fused_quant": "JETRL_FUSED_QUANT",
  "fused_mlp": "JETRL_FUSED_MLP",
  "decode_gemm": "JETRL_DECODE_GEMM",
  "exact_cpu_kernel": "JETRL_EXACT_CPU_KERNEL",
  "cublaslt_graphs": "JETRL_CUBLASLT_GRAPHS",
}


def _flag(name: str, value: str) -> bool:
  """A 0 / 1 variable as a bool."""
  if value not in ("0", "1"):
    raise ValueError(f"{name} must be 0, 1 or unset (the default), got {value!r}")
  return value == "1"


def _choice(name: str, value: str, accepted: tuple) -> str:
  if value not in accepted:
    raise ValueError(f"{name} must be one of {list(accepted)} or unset, got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which kernels run where several compute the same numbers (static, hashable): the run
  config's `kernels` node. Where they differ, it is only in the order of float32 sums
  (docs/numerics.md), so a run may resume with other settings."""

  gemm_backend: str = field(
    "auto",
    "What an FP8 GEMM whose recipe says auto runs on (auto: cuBLASLt on a Hopper GPU for "
    "1x128 block scaling, else XLA; a recipe's own backend wins). Default from "
    "JETRL_GEMM_BACKEND.",
    choices=GEMM_BACKENDS,
  )
  fused_quant: Optional[bool] = field(
    None,
    "cuBLASLt's operands quantized by the one-pass Pallas kernel (none: on in programs compiled "
    "for a GPU). Default from JETRL_FUSED_QUANT (0 / 1).",
  )
  fused_mlp: bool = field(
    True,
    "On a GPU, the SwiGLU MLP and the RMSNorm before a projection write the GEMMs' FP8 groups "
    "in their own kernels, where the shapes are whole tiles. Default from JETRL_FUSED_MLP.",
  )
  decode_gemm: str = field(
    "cublaslt",
    "A decode step's FP8 GEMM: cuBLASLt, or the decode-size Pallas kernel. Default from "
    "JETRL_DECODE_GEMM.",
    choices=DECODE_GEMMS,
  )
  exact_cpu_kernel: bool = field(
    True,
    "jet_exact's exact sums in the CPU kernels where usable (one CPU device; the same bits as "
    "XLA's path, faster). Default from JETRL_EXACT_CPU_KERNEL.",
  )
  cublaslt_graphs: bool = field(
    True,
    "The cuBLASLt FFI call captured in XLA's command buffers (CUDA graphs); false keeps it "
    "out. Default from JETRL_CUBLASLT_GRAPHS.",
  )

  def __post_init__(self):
    check_fields(self)

  @staticmethod
  def env_values(environ: Optional[Mapping[str, str]] = None) -> dict[str, tuple[str, Any]]:
    """{field: (variable, value)} of each variable of the module doc's table that is set (and
    not empty) in `environ` (default: the process's environment); a bad value is a
    ValueError naming the variable."""
    env = os.environ if environ is None else environ
    out = {}
    for name, var in ENV_VARIABLES.items():
      text = env.get(var, "").strip()
      if not text:
        continue
      if name == "gemm_backend":
        value = _choice(var, text.lower(), GEMM_BACKENDS)
      elif name == "decode_gemm":
        value = _choice(var, text, DECODE_GEMMS)
      else:
        value = _flag(var, text)
      out[name] = (var, value)
    return out

  @classmethod
  def from_env(
    cls, environ: Optional[Mapping[str, str]] = None, base: Optional["KernelConfig"] = None
  ) -> "KernelConfig":
    """`base` (default: the defaults) with the settings the environment variables give (the
    module doc's table)."""
    changes = {name: value for name, (_, value) in cls.env_values(environ).items()}
    return dataclasses.replace(cls() if base is None else base, **changes)


def kernel_defaults(tree: Any, environ: Optional[Mapping[str, str]] = None):
  """(`tree` with its `kernels` node's fields set by the environment variables that are set,
  the lines that say so): where an entry point builds its configuration (`jetrl.train.cli`,
  experiments/compile_report.py), before its flags and config file apply on top. A tree
  without that node comes back as it is. A bad value is a ValueError naming the variable."""
  if not isinstance(getattr(tree, "kernels", None), KernelConfig):
    return tree, []
  found = KernelConfig.env_values(environ)
  if not found:
    return tree, []
  changed = replace(tree, {f"kernels.{name}": value for name, (_, value) in found.items()})
  show = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
  notes = [
    f"{var} sets the default of --kernels.{name} to {show(value)} (a flag or --config overrides it)"
    for name, (var, value) in found.items()
  ]
  return changed, notes


@dataclasses.dataclass(frozen=True)
class Device:
  """The device a program is traced for, and the kernel settings it is traced with.

  platform: JAX's platform name ("cpu", "gpu", "tpu"); compute_capability: an NVIDIA GPU's
  ("9.0"), None elsewhere or for this machine's own device (read from it where needed);
  interpret: a GPU program run here, its Pallas kernels interpreted and its FP8 GEMMs on XLA;
  memory_bytes: the device's memory (0: unknown: this machine's device says, where asked);
  compiling: a compile-only target (`jetrl.aot`), not this machine's device."""

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


# The compile-only device `jetrl.aot.tracing_for` traces for: code outside jetrl that calls
# `jetrl.sampling.sample` inside it passes no device, so the plan resolved there has no other
# way to learn it. Set only by `tracing`; read only by `current_device`.
_TRACING: contextvars.ContextVar[Optional[Device]] = contextvars.ContextVar(
  "jetrl_tracing_device", default=None
)


@contextlib.contextmanager
def tracing(dev: Device) -> Iterator[Device]:
  """Plans resolved without a device inside are for `dev` (`jetrl.aot.tracing_for`)."""
  token = _TRACING.set(dev)
  try:
    yield dev
  finally:
    _TRACING.reset(token)


def current_device(kernels: Optional[KernelConfig] = None) -> Device:
  """The device a plan resolved without one is for: JAX's default backend, or the compile-only
  target inside `tracing`; with `kernels`, else the environment's settings
  (`KernelConfig.from_env`) or, inside `tracing`, its device's."""
  dev = _TRACING.get()
  if dev is not None:
    return dev if kernels is None else dataclasses.replace(dev, kernels=kernels)
  kernels = KernelConfig.from_env() if kernels is None else kernels
  return Device(jax.default_backend(), kernels=kernels)
