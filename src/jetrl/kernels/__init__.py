"""How the numbers are computed: the GEMM, quantization, norm, SwiGLU and attention kernels
(Pallas, cuBLASLt's FFI call, the CPU's exact kernels), which of them runs where, and the
only place that knows devices. What the numbers are is `jetrl.precision`'s."""

from jetrl.kernels.gemm_pallas import scaled_matmul_nt
from jetrl.kernels.linear import linear

__all__ = ["linear", "scaled_matmul_nt"]
