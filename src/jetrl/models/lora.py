"""LoRA: low-rank adapters on a frozen base, in the one params pytree the sampler and the
update share.

A targeted projection w [K, N] becomes y = x @ w + (alpha / r) (x @ a) @ b, with a [K, r] and
b [r, N] trained and w frozen (docs/lora.md). The adapters live apart from the base:

  adapters = {"wq": {"a": [L, K, r], "b": [L, r, N]}, ...}   # the trained params
  params   = attach(base, adapters, cfg)                      # what the model reads

`attach` puts a `LoraWeight(base, a, b, scale)` where each targeted projection was; the model's
projections (`layers.project`) run it as `lora_linear`. Everything else in the base (norms,
embeddings, the LM head, untargeted projections) is frozen as it is.

`freeze_base` quantizes the base's projection weights once, with the training fprop's own
quantizer, when the training precision runs its fprop and dgrad in FP8 from the same weight
blocks (jet, fp8_tensor, jet_exact): the training forward, its backward (dx from the same FP8
blocks) and the rollout then all read one `QuantizedWeight` per projection, bit-identical to
quantizing the stored weight at every step. The adapters' two GEMMs run in the recipe's
compute dtype (bf16, float32 sums); under a batch-invariant precision with exact dots, so that
a token's output does not depend on the batch (docs/numerics.md, "Bitwise on-policy").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.config import ConfigError, check_fields, field
from jetrl.models.config import ModelConfig
from jetrl.models.params import LINEAR_WEIGHTS, param_shapes
from jetrl.kernels.plan import Plan, plan_for
from jetrl.precision import Precision, QuantizedWeight, prequantize_weight

# --lora.targets name -> the projection's params name (and its Hugging Face module name).
TARGETS = {
  "q": "wq",
  "k": "wk",
  "v": "wv",
  "o": "wo",
  "gate": "w_gate",
  "up": "w_up",
  "down": "w_down",
}
HF_MODULES = {
  "wq": "self_attn.q_proj",
  "wk": "self_attn.k_proj",
  "wv": "self_attn.v_proj",
  "wo": "self_attn.o_proj",
  "w_gate": "mlp.gate_proj",
  "w_up": "mlp.up_proj",
  "w_down": "mlp.down_proj",
}
assert set(TARGETS.values()) == set(LINEAR_WEIGHTS) == set(HF_MODULES)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA adapters on a frozen base (rank 0: every weight is trained)."""

  rank: int = field(
    0, "LoRA rank r: train rank-r adapters on a frozen base (0: full fine-tuning).", lo=0, hi=4096
  )
  alpha: float = field(
    16.0,
    "LoRA alpha: the adapters' output is scaled by alpha / rank.",
    lo=0.0,
    hi=1e6,
    lo_open=True,
  )
  targets: tuple[str, ...] = field(
    tuple(TARGETS),
    "Projections that get adapters, any of: " + ", ".join(TARGETS) + ".",
    choices=tuple(TARGETS),
  )

  def __post_init__(self):
    check_fields(self)
    if not self.targets:
      raise ConfigError("targets", f"needs at least one of {', '.join(TARGETS)}")
    if len(set(self.targets)) != len(self.targets):
      raise ConfigError("targets", f"lists a projection twice: {','.join(self.targets)}")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """alpha / rank, the factor on the adapters' output (PEFT's `scaling`)."""
    return self.alpha / self.rank

  @property
  def weights(self) -> tuple[str, ...]:
    """The targeted projections' params names, in the model's order."""
    chosen = {TARGETS[t] for t in self.targets}
    return tuple(w for w in LINEAR_WEIGHTS if w in chosen)


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=("base", "a", "b"), meta_fields=("scale",)
)
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """A frozen projection with its adapters: y = x @ base + scale (x @ a) @ b.

  base: [..., K, N], the stored weight or a `QuantizedWeight` of it (frozen either way);
  a: [..., K, r]; b: [..., r, N]; scale: static (alpha / r). Leading axes (stacked layers)
  slice like a weight's.
  """

  base: Any
  a: jax.Array
  b: jax.Array
  scale: float

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.base.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)


def check_model(config: ModelConfig, cfg: LoraConfig) -> None:
  """ValueError when `config` cannot take adapters: a mixture of experts (its MLP is experts,
  not the dense gate / up / down projections the adapters target)."""
  if cfg.enabled and config.moe:
    raise ValueError(
      f"--lora.rank={cfg.rank}: LoRA adapts the dense projections, and {config.family!r} is a "
      f"mixture of experts ({config.n_experts} experts in every layer's MLP); LoRA on a mixture "
      f"of experts is not supported: set --lora.rank=0 (full fine-tuning)"
    )


def adapter_shapes(config: ModelConfig, cfg: LoraConfig) -> dict:
  """{projection: {"a": (L, K, r), "b": (L, r, N)}} for the targeted projections."""
  check_model(config, cfg)
  layers = param_shapes(config)["layers"]
  out = {}
  for name in cfg.weights:
    n_layers, k, n = layers[name]
    out[name] = {"a": (n_layers, k, cfg.rank), "b": (n_layers, cfg.rank, n)}
  return out


def init_adapters(config: ModelConfig, cfg: LoraConfig, key: jax.Array) -> dict:
  """float32 adapters as PEFT initialises them: a ~ U(-1/sqrt(K), 1/sqrt(K)) (torch's
  kaiming-uniform with a = sqrt(5)), b = 0, so the adapted model starts as the base."""
  if not cfg.enabled:
    raise ValueError("init_adapters: LoraConfig.rank is 0 (no adapters)")
  shapes = adapter_shapes(config, cfg)
  keys = jax.random.split(key, len(shapes))
  out = {}
  for k, (name, s) in zip(keys, shapes.items()):
    bound = 1.0 / math.sqrt(s["a"][1])
    a = jax.random.uniform(k, s["a"], jnp.float32, -bound, bound)
    out[name] = {"a": a, "b": jnp.zeros(s["b"], jnp.float32)}
  return out


def check_adapters(adapters, config: ModelConfig, cfg: LoraConfig) -> None:
  """ValueError naming the first adapter that is missing, unexpected or mis-shaped."""
  expected = adapter_shapes(config, cfg)
  if not isinstance(adapters, dict) or set(adapters) != set(expected):
    got = sorted(adapters) if isinstance(adapters, dict) else type(adapters).__name__
    raise ValueError(f"adapters must hold {sorted(expected)} (--lora.targets), got {got}")
  for name, parts in expected.items():
    for part, shape in parts.items():
      got = tuple(getattr(adapters[name].get(part), "shape", ()))
      if got != shape:
        raise ValueError(
          f"adapters[{name!r}][{part!r}] has shape {got}, expected {shape} for this model "
          f"and --lora.rank={cfg.rank}"
        )


def attach(base, adapters, cfg: LoraConfig):
  """The params the model reads: `base` with each targeted projection a `LoraWeight`."""
  layers = dict(base["layers"])
  for name in cfg.weights:
    layers[name] = LoraWeight(layers[name], adapters[name]["a"], adapters[name]["b"], cfg.scale)
  return dict(base, layers=layers)


def quantizes_base(precision: Optional[Precision]) -> bool:
  """True when `freeze_base` quantizes the base once for this training precision: an FP8
  fprop whose dgrad reads the same weight blocks (then no stored-dtype copy is needed)."""
  if precision is None or precision.fprop is None or precision.dgrad is None:
    return False
  f, d = precision.fprop, precision.dgrad
  return (f.scaling, f.block, f.fmt, f.pow2_scale) == (d.scaling, d.block, d.fmt, d.pow2_scale)


def freeze_base(base, precision: Optional[Precision], plan: Optional[Plan] = None):
  """The frozen base for training under `precision`: its projection weights quantized once
  in the layout the training fprop of `plan` reads (default: the plan resolved for it now;
  see the module doc), or unchanged."""
  if "router" in base["layers"]:
    raise ValueError(
      "freeze_base: the base is a mixture of experts; LoRA on a mixture of experts is not "
      "supported (--lora.rank=0)"
    )
  if not quantizes_base(precision):
    return base
  g = precision.fprop
  k_major = plan_for(precision, plan).weight_k_major(g)  # as linear's own forward
  layers = dict(base["layers"])
  for name in LINEAR_WEIGHTS:
    w = layers[name]
    if not isinstance(w, QuantizedWeight):
      layers[name] = prequantize_weight(w, g, k_major=k_major)
  return dict(base, layers=layers)


def merge(base, adapters, cfg: LoraConfig):
  """float32 params with the adapters merged: w + scale * a @ b (float64 products, the stored
  base weights: not a `freeze_base` result)."""
  layers = dict(base["layers"])
  for name in cfg.weights:
    w = layers[name]
    if isinstance(w, QuantizedWeight):
      raise ValueError(f"merge: base {name!r} is quantized; merge into the stored weights")
    a = np.asarray(jax.device_get(adapters[name]["a"]), np.float64)
    b = np.asarray(jax.device_get(adapters[name]["b"]), np.float64)
    delta = cfg.scale * np.einsum("lkr,lrn->lkn", a, b)
    layers[name] = jnp.asarray(np.asarray(jax.device_get(w), np.float64) + delta, jnp.float32)
  return dict(base, layers=layers)


def lora_linear(x: jax.Array, w: LoraWeight, plan: Union[Plan, Precision, None], cd) -> jax.Array:
  """x @ base + scale (x @ a) @ b in cd: the base GEMM under the plan's precision (FP8 under
  jet), the adapters' GEMMs in the compute dtype (`Plan.adapter_dot`), one rounding of the
  sum. No gradient reaches the base."""
  plan = plan_for(plan)
  base = w.base if isinstance(w.base, QuantizedWeight) else jax.lax.stop_gradient(w.base)
  y = plan.linear(x, base)
  u = plan.adapter_dot(x.astype(cd), w.a, cd)
  v = plan.adapter_dot(u.astype(cd), w.b, cd)
  return (y.astype(jnp.float32) + w.scale * v.astype(jnp.float32)).astype(cd)
