"""Precision settings and the public recipes.

A `Precision` says how one linear layer computes: the compute dtype between operators and,
for each of the three GEMMs (fprop, dgrad, wgrad), whether it runs in FP8 and how it is scaled.
A `Recipe` pairs the precision of the training step with that of the rollout. Everything is a
frozen, hashable dataclass, static under `jit`: there is no FP8 state anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax.numpy as jnp

from jetrl.precision.formats import COMPUTE_DTYPES, FORMATS

SCALINGS = ("block", "tensor")
# What the rollout's KV cache holds (`Precision.kv_cache`): keys and values in the compute
# dtype, or in E4M3 with float32 scales (jetrl.precision.kv_cache); and the recipes that take
# the FP8 one (`get_recipe(..., kv_cache=...)`).
KV_CACHES = ("compute", "fp8")
KV_CACHE_RECIPES = ("fp8_rollout", "jet", "jet_exact")
# Which implementation runs an FP8 GEMM (`Fp8Gemm.gemm_backend`; jetrl.kernels.backend).
GEMM_BACKENDS = ("auto", "xla", "cublaslt", "pallas", "pallas_interpret")


def check_backend(name: str, what: str = "gemm_backend") -> str:
  """`name` if it is one of GEMM_BACKENDS, else a ValueError listing them."""
  if name not in GEMM_BACKENDS:
    raise ValueError(f"unknown {what} {name!r}; accepted: {list(GEMM_BACKENDS)}")
  return name


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
  """How the operands of one FP8 GEMM are quantized.

  scaling: "block" (activations and gradients in 1x`block` groups along the contraction
    axis, or `block`x1 groups over tokens for wgrad; weights in `block`x`block` tiles) or
    "tensor" (one current scale per operand: batch-dependent, a studied baseline).
  fmt: format of activations and weights ("e4m3").
  grad_fmt: format of the incoming gradient dy in dgrad / wgrad ("e4m3" or "e5m2").
  pow2_scale: round scales up to powers of two.
  gemm_backend: which implementation runs the GEMM: "auto" (cuBLASLt on Hopper, the Pallas
    kernel on other FP8-capable GPUs, XLA elsewhere), "xla", "cublaslt", "pallas" or
    "pallas_interpret"; see jetrl.kernels.backend. The FP8 values and scales are the same
    on every backend.
  """

  scaling: str = "block"
  block: int = 128
  fmt: str = "e4m3"
  grad_fmt: str = "e4m3"
  pow2_scale: bool = False
  gemm_backend: str = "auto"

  def __post_init__(self):
    check_backend(self.gemm_backend)
    if self.scaling not in SCALINGS:
      raise ValueError(f"unknown FP8 scaling {self.scaling!r}; accepted: {list(SCALINGS)}")
    for field in ("fmt", "grad_fmt"):
      if getattr(self, field) not in FORMATS:
        raise ValueError(
          f"unknown FP8 format {field}={getattr(self, field)!r}; accepted: {sorted(FORMATS)}"
        )
    if not isinstance(self.block, int) or self.block < 1:
      raise ValueError(f"block must be a positive int, got {self.block!r}")


@dataclasses.dataclass(frozen=True)
class Precision:
  """Precision of a linear layer. `None` for a GEMM means: plain matmul in compute_dtype.

  batch_invariant: the forward computes every sum exactly (the FP8 GEMM's blocks in float64,
    attention, norms, LM head and log-softmax on fixed-point grids; jetrl.precision.exact and
    jetrl.kernels.exact_ops), so a token's log-probs do not depend on the batch, the padding or
    the program that computes them. Needs a block-scaled E4M3 fprop; the backward is the
    usual one. The exact forward GEMM runs in XLA whatever the fprop's `gemm_backend` says.
  kv_cache: "compute" (keys and values in the compute dtype) or "fp8": attention reads keys
    (after RoPE) and values quantized per token and kv head in E4M3, 1 x 128 groups along the
    head dimension, and dequantized (jetrl.precision.kv_cache); a rollout's KV cache stores
    them so (FP8 values and float32 scales), a training forward reads the same values with
    the gradient passed straight through the rounding. Carried by `forward`.
  """

  compute_dtype: str = "bfloat16"
  fprop: Optional[Fp8Gemm] = None
  dgrad: Optional[Fp8Gemm] = None
  wgrad: Optional[Fp8Gemm] = None
  batch_invariant: bool = False
  kv_cache: str = "compute"

  def __post_init__(self):
    if self.kv_cache not in KV_CACHES:
      raise ValueError(f"unknown kv_cache {self.kv_cache!r}; accepted: {list(KV_CACHES)}")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(
        f"unknown compute dtype {self.compute_dtype!r}; accepted: {sorted(COMPUTE_DTYPES)}"
      )
    if not isinstance(self.batch_invariant, bool):
      raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
    g = self.fprop
    if self.batch_invariant and (
      g is None or g.scaling != "block" or g.fmt != "e4m3" or g.block > 128
    ):
      raise ValueError(
        "batch_invariant needs an fprop with block scaling, fmt 'e4m3' and block <= 128 "
        "(its block sums are exact in float64); got "
        + ("no fprop" if g is None else f"scaling={g.scaling!r}, fmt={g.fmt!r}, block={g.block}")
      )

  @property
  def forward(self) -> "Precision":
    """The forward half of this precision: the same compute dtype, the same fprop object and
    the same KV cache.

    This is what a rollout under the unified flow runs; it shares `fprop` with the training
    precision by identity, so the two cannot diverge.
    """
    return Precision(
      compute_dtype=self.compute_dtype,
      fprop=self.fprop,
      batch_invariant=self.batch_invariant,
      kv_cache=self.kv_cache,
    )

  @property
  def is_fp8(self) -> bool:
    return any(g is not None for g in (self.fprop, self.dgrad, self.wgrad))


def is_batch_invariant(precision: Optional[Precision]) -> bool:
  """True for a precision whose forward is batch-invariant (see Precision.batch_invariant)."""
  return precision is not None and precision.batch_invariant


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A named pair of precisions: `.train` for the update, `.rollout` for the sampler.

  When `rollout_override` is None the rollout is `train.forward`, by construction.
  """

  name: str
  train: Precision
  rollout_override: Optional[Precision] = None
  description: str = ""

  @property
  def rollout(self) -> Precision:
    if self.rollout_override is None:
      return self.train.forward
    return self.rollout_override

  @property
  def unified(self) -> bool:
    """True when the rollout runs exactly the training forward."""
    return self.rollout == self.train.forward

  @property
  def fp8_backward(self) -> bool:
    """True when the training step's dgrad or wgrad GEMMs run in FP8 (so `grad_fmt` matters)."""
    return self.train.dgrad is not None or self.train.wgrad is not None

  @property
  def compute_bytes(self) -> int:
    """Bytes of one value between operators in the training step (2 for bf16, 4 for fp32)."""
    return jnp.dtype(COMPUTE_DTYPES[self.train.compute_dtype]).itemsize


def _fp8_train(gemm: Fp8Gemm, **kw) -> Precision:
  """bf16 between operators, every GEMM in FP8 (one settings object shared by the three)."""
  return Precision("bfloat16", fprop=gemm, dgrad=gemm, wgrad=gemm, **kw)


def _fp32(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe("fp32", Precision("float32"), description="fp32 everywhere (parity tests)")


def _bf16(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe("bf16", Precision("bfloat16"), description="bf16 train and rollout")


def _fp8_rollout(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "fp8_rollout",
    Precision("bfloat16"),
    rollout_override=Precision("bfloat16", fprop=block),
    description="bf16 training, FP8 blockwise rollout (off-policy baseline)",
  )


def _jet(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "jet", _fp8_train(block), description="FP8 fprop/dgrad/wgrad; rollout = the training fprop"
  )


def _fp8_tensor(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "fp8_tensor",
    _fp8_train(tensor),
    description="FP8 per-tensor current scaling (batch-dependent baseline)",
  )


def _jet_exact(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "jet_exact",
    _fp8_train(block, batch_invariant=True),
    description="jet with a batch-invariant forward: rollout log-probs equal the "
    "training forward's bit for bit",
  )


def _fp8_rollout_tensor(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "fp8_rollout_tensor",
    Precision("bfloat16"),
    rollout_override=Precision("bfloat16", fprop=Fp8Gemm(scaling="tensor")),
    description="bf16 training, FP8 rollout with one current scale per tensor (uncalibrated "
    "per-tensor E4M3, as a plain online FP8 rollout runs): more mismatch than fp8_rollout",
  )


def _fp8_rollout_e5m2(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "fp8_rollout_e5m2",
    Precision("bfloat16"),
    rollout_override=Precision("bfloat16", fprop=Fp8Gemm(scaling="block", fmt="e5m2")),
    description="bf16 training, blockwise FP8 rollout in E5M2 (2 mantissa bits instead of 3): "
    "more mismatch than fp8_rollout",
  )


def _jet_exact_rollout(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  exact = _fp8_train(block, batch_invariant=True)
  return Recipe(
    "jet_exact_rollout",
    _fp8_train(block),
    rollout_override=exact.forward,
    description="jet's training step with jet_exact's rollout (the 2x2 crossover: jet "
    "training arithmetic, bitwise rollout)",
  )


def _jet_exact_train(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "jet_exact_train",
    _fp8_train(block, batch_invariant=True),
    rollout_override=_fp8_train(block).forward,
    description="jet_exact's training step with jet's rollout (the 2x2 crossover: exact "
    "training arithmetic, jet's rollout)",
  )


def _jet_exact_train_bf16_rollout(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "jet_exact_train_bf16_rollout",
    _fp8_train(block, batch_invariant=True),
    rollout_override=Precision("bfloat16"),
    description="jet_exact's training step with a bf16 rollout (no FP8 in the rollout: "
    "the mismatch of FP8 rounding itself, under the exact trainer)",
  )


def _jet_exact_train_e5m2_rollout(block: Fp8Gemm, tensor: Fp8Gemm) -> Recipe:
  return Recipe(
    "jet_exact_train_e5m2_rollout",
    _fp8_train(block, batch_invariant=True),
    rollout_override=Precision("bfloat16", fprop=Fp8Gemm(scaling="block", fmt="e5m2")),
    description="jet_exact's training step with a blockwise E5M2 rollout (more mismatch than "
    "jet's E4M3 rollout, under the exact trainer)",
  )


# The recipes, by name: each builder takes the block-scaled and the per-tensor FP8 GEMM
# settings (with the run's gradient format) and returns its Recipe. A new recipe is one
# builder and one entry here; everything downstream reads the Recipe object.
BUILDERS = {
  "fp32": _fp32,
  "bf16": _bf16,
  "fp8_rollout": _fp8_rollout,
  "jet": _jet,
  "fp8_tensor": _fp8_tensor,
  "jet_exact": _jet_exact,
  # Rollouts of rising mismatch under a bf16 trainer (the study's dose-response).
  "fp8_rollout_tensor": _fp8_rollout_tensor,
  "fp8_rollout_e5m2": _fp8_rollout_e5m2,
  # The crossover {jet, jet_exact} training x {jet, jet_exact} rollout.
  "jet_exact_rollout": _jet_exact_rollout,
  "jet_exact_train": _jet_exact_train,
  # The exact trainer with rollouts of rising mismatch (the fourth round's crossover, which
  # varies only the rollout: jet_exact, jet_exact_train and these two).
  "jet_exact_train_bf16_rollout": _jet_exact_train_bf16_rollout,
  "jet_exact_train_e5m2_rollout": _jet_exact_train_e5m2_rollout,
}
RECIPES = tuple(BUILDERS)


def get_recipe(name: str, *, grad_fmt: str = "e4m3", kv_cache: str = "compute") -> Recipe:
  """The recipe called `name` (one of RECIPES). `grad_fmt` selects E4M3 or E5M2 gradients:
  a recipe whose backward runs no FP8 GEMM accepts only the default (it would be ignored).
  `kv_cache` "fp8" gives the rollout an FP8 KV cache (`with_kv_cache`; the recipes of
  KV_CACHE_RECIPES)."""
  if name not in BUILDERS:
    raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}")
  if grad_fmt not in FORMATS:
    raise ValueError(f"unknown gradient format {grad_fmt!r}; accepted: {sorted(FORMATS)}")
  block = Fp8Gemm(scaling="block", grad_fmt=grad_fmt)
  tensor = Fp8Gemm(scaling="tensor", grad_fmt=grad_fmt)
  recipe = BUILDERS[name](block, tensor)
  if grad_fmt != "e4m3" and not recipe.fp8_backward:
    raise ValueError(
      f"gradient format {grad_fmt!r} needs a recipe whose backward runs in FP8 "
      f"({', '.join(n for n in RECIPES if BUILDERS[n](block, tensor).fp8_backward)}); "
      f"{name!r} computes its gradients in {recipe.train.compute_dtype}"
    )
  if kv_cache not in KV_CACHES:
    raise ValueError(f"unknown kv_cache {kv_cache!r}; accepted: {list(KV_CACHES)}")
  if kv_cache != "compute":
    if name not in KV_CACHE_RECIPES:
      raise ValueError(
        f"kv_cache {kv_cache!r} needs a recipe with an FP8 rollout that takes it "
        f"({', '.join(KV_CACHE_RECIPES)}); {name!r} keeps its KV cache in its compute dtype"
      )
    recipe = with_kv_cache(recipe, kv_cache)
  return recipe


def with_kv_cache(recipe: Recipe, kv_cache: str) -> Recipe:
  """A copy of `recipe` whose rollout keeps its KV cache as `kv_cache` says.

  A unified recipe (jet, jet_exact) changes its training precision, so that the training
  forward's attention reads the keys and values the rollout's cache holds (the unified flow:
  the rollout stays `train.forward`). A recipe with a rollout of its own (fp8_rollout)
  changes only that rollout, as an inference engine's FP8 KV cache does: its training
  forward never sees the rounding (off-policy, like its FP8 GEMMs).
  """
  if recipe.unified:
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, kv_cache=kv_cache))
  return dataclasses.replace(
    recipe, rollout_override=dataclasses.replace(recipe.rollout_override, kv_cache=kv_cache)
  )


def with_gemm_backend(obj: Union[Fp8Gemm, Precision, Recipe, None], name: str):
  """A copy of an Fp8Gemm, Precision or Recipe whose every FP8 GEMM uses backend `name`.

  A Recipe whose rollout is its training forward stays unified (the rollout is derived from
  the new training precision, sharing its fprop object).
  """
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

    return dataclasses.replace(
      obj, fprop=sub(obj.fprop), dgrad=sub(obj.dgrad), wgrad=sub(obj.wgrad)
    )
  if isinstance(obj, Recipe):
    return dataclasses.replace(
      obj,
      train=with_gemm_backend(obj.train, name),
      rollout_override=with_gemm_backend(obj.rollout_override, name),
    )
  raise TypeError(f"with_gemm_backend: expected an Fp8Gemm, Precision or Recipe, got {type(obj)}")
