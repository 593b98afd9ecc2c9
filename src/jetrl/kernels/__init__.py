"""How the numbers are computed: the GEMM, quantization, norm, SwiGLU and attention kernels
(Pallas, cuBLASLt's FFI call, the CPU's exact kernels), which of them runs where (`Plan`,
resolved once by `resolve_plan`), and the only place that knows devices. What the numbers are
is `jetrl.precision`'s."""

from jetrl.kernels.device import Device, KernelConfig, current_device
from jetrl.kernels.gemm_pallas import scaled_matmul_nt
from jetrl.kernels.linear import linear
from jetrl.kernels.plan import Blocks, Plan, resolve_plan

__all__ = [
  "Blocks",
  "Device",
  "KernelConfig",
  "Plan",
  "current_device",
  "linear",
  "resolve_plan",
  "scaled_matmul_nt",
]
