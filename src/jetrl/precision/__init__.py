"""FP8 numerics: formats, tile-wise quantization, the FP8 `linear`, and recipes."""

from jetrl.precision.formats import E4M3, E5M2, FORMATS, fp8_max
from jetrl.precision.fp8_checks import Fp8Check, check_fp8_in_compiled
from jetrl.precision.linear import linear
from jetrl.precision.quantize import dequantize, quantize, scale_shape
from jetrl.precision.recipes import (
  GEMM_BACKENDS,
  KV_CACHE_RECIPES,
  KV_CACHES,
  RECIPES,
  Fp8Gemm,
  Precision,
  Recipe,
  get_recipe,
  is_batch_invariant,
  with_gemm_backend,
)
from jetrl.precision.weights import (
  QuantizedInput,
  QuantizedWeight,
  prequantize_weight,
  quantize_weight,
)

__all__ = [
  "E4M3",
  "E5M2",
  "FORMATS",
  "fp8_max",
  "linear",
  "quantize_weight",
  "QuantizedWeight",
  "QuantizedInput",
  "prequantize_weight",
  "dequantize",
  "quantize",
  "scale_shape",
  "RECIPES",
  "KV_CACHES",
  "KV_CACHE_RECIPES",
  "Fp8Gemm",
  "Precision",
  "Recipe",
  "get_recipe",
  "is_batch_invariant",
  "GEMM_BACKENDS",
  "with_gemm_backend",
  "Fp8Check",
  "check_fp8_in_compiled",
]
