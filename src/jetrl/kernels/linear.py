"""`linear(x, w, precision)` on the kernels: `jetrl.precision.linear`'s GEMMs computed where
each `Fp8Gemm.gemm_backend` says (cuBLASLt, Pallas or XLA; jetrl.kernels.backend,
jetrl.kernels.gemms), the batch-invariant forward GEMM on the CPU kernel where it serves
(jetrl.kernels.exact_gemm). The FP8 values and scales are `quantize`'s on every backend."""

from __future__ import annotations

from typing import Optional

import jax

from jetrl.kernels import backend as _backend
from jetrl.kernels import exact_gemm as _exact_gemm
from jetrl.kernels import gemms as _gemms
from jetrl.precision.linear import linear as _precision_linear
from jetrl.precision.recipes import Precision
from jetrl.precision.weights import QuantizedInput, QuantizedWeight
from jetrl.precision.xla_gemms import XlaGemms


class KernelGemms(XlaGemms):
  """`linear`'s GEMMs on the kernels (the methods of `xla_gemms.XlaGemms`)."""

  def k_major(self, g, exact: bool) -> bool:
    return _backend.wants_k_major(g) and not exact

  def matmul_cd(self, a, b, cd):
    return _gemms.matmul_cd(a, b, cd)

  def fprop(self, x2, w: QuantizedWeight, g, cd, exact: bool):
    if exact:  # batch-invariant: exact float64 block sums in a fixed order
      return _exact_gemm.fp8_fprop(x2, *w.kn(), g)
    return _gemms.fprop(x2, w, g, cd)

  def fprop_quantized(self, x: QuantizedInput, w: QuantizedWeight, g, cd):
    return _gemms.fprop_quantized(x, w, g, cd)

  def dgrad(self, dy2, w: QuantizedWeight, g, cd):
    return _gemms.dgrad(dy2, w, g, cd)

  def wgrad(self, x2, dy2, g, out_dtype):
    return _gemms.wgrad(x2, dy2, g, out_dtype)


KERNELS = KernelGemms()


def linear(x: jax.Array, w, precision: Optional[Precision] = None) -> jax.Array:
  """`jetrl.precision.linear(x, w, precision)` with its GEMMs on the kernels."""
  return _precision_linear(x, w, precision, gemms=KERNELS)
