"""Model configuration: a frozen, hashable dataclass (a static `jit` argument) and presets."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jetrl.models.families import family_spec


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 rope scaling ("rope_type": "llama3" in a Hugging Face config).

  Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided by
  `factor`, shorter than `original_max_position_embeddings / high_freq_factor` are kept, and the
  band in between is interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if not self.factor > 0:
      raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
        "rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
        f"high_freq_factor={self.high_freq_factor!r}, low_freq_factor={self.low_freq_factor!r}"
      )
    if not self.original_max_position_embeddings > 0:
      raise ValueError(
        "rope_scaling.original_max_position_embeddings must be > 0, got "
        f"{self.original_max_position_embeddings!r}"
      )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer (Llama / Qwen2 / Qwen2.5 / Qwen3).

  family: a name in `jetrl.models.families.FAMILIES` ("llama", "qwen2" (also Qwen2.5),
  "qwen3", ...); it names the checkpoint architecture (its `FamilySpec`).
  head_dim is explicit (Qwen3 has n_heads * head_dim != d_model).
  qkv_bias: biases on the q, k, v projections (Qwen2). qk_norm: per-head RMSNorm on q and k
  before RoPE (Qwen3). tie_embeddings: the LM head is the transposed embedding matrix.
  n_experts > 0 (a family whose spec has `moe`; 0 otherwise): every layer's MLP is a mixture of
  n_experts SwiGLU experts of width moe_d_ff, each token's output the sum of its
  experts_per_token best experts' outputs weighted by the router's softmax probabilities
  (renormalised over those experts with norm_topk_prob; `jetrl.models.moe`). d_ff is then
  unused by the layers (config.json's intermediate_size, kept for the round trip), as is
  router_aux_loss_coef (config.json's; the update's own `router_aux_coef` decides).
  """

  family: str = "llama"
  vocab_size: int = 128
  d_model: int = 256
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 64
  d_ff: int = 512
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  max_seq_len: int = 2048
  n_experts: int = 0
  experts_per_token: int = 0
  moe_d_ff: int = 0
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    spec = family_spec(self.family)  # ValueError naming the accepted families
    self._check_moe(spec.moe)
    for field in (
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "head_dim",
      "d_ff",
      "max_seq_len",
    ):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
        f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
    if not self.rms_eps > 0:
      raise ValueError(f"ModelConfig.rms_eps must be > 0, got {self.rms_eps!r}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
        "ModelConfig.rope_scaling must be None or a RopeScaling, got "
        f"{type(self.rope_scaling).__name__}"
      )

  def _check_moe(self, moe: bool) -> None:
    for field in ("n_experts", "experts_per_token", "moe_d_ff"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ModelConfig.{field} must be an int >= 0, got {value!r}")
    if not moe:
      if self.n_experts or self.experts_per_token or self.moe_d_ff:
        raise ValueError(
          f"ModelConfig(family={self.family!r}) has a dense MLP: n_experts, experts_per_token "
          f"and moe_d_ff must be 0, got {self.n_experts}, {self.experts_per_token}, "
          f"{self.moe_d_ff} (a mixture of experts is family 'qwen3_moe')"
        )
      return
    if self.n_experts < 1 or self.moe_d_ff < 1:
      raise ValueError(
        f"ModelConfig(family={self.family!r}) is a mixture of experts: n_experts and moe_d_ff "
        f"must be >= 1, got {self.n_experts} and {self.moe_d_ff}"
      )
    if not 1 <= self.experts_per_token <= self.n_experts:
      raise ValueError(
        f"ModelConfig.experts_per_token must be between 1 and n_experts ({self.n_experts}), "
        f"got {self.experts_per_token}"
      )
    if not self.router_aux_loss_coef >= 0:
      raise ValueError(
        f"ModelConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}"
      )

  @property
  def moe(self) -> bool:
    """Whether every layer's MLP is a mixture of experts."""
    return self.n_experts > 0

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  @property
  def n_params(self) -> int:
    """Number of parameters (the LM head counted once when tied)."""
    d, f, v = self.d_model, self.d_ff, self.vocab_size
    mlp = self.n_experts * (3 * d * self.moe_d_ff + d) if self.moe else 3 * d * f
    per_layer = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + mlp + 2 * d
    if self.qkv_bias:
      per_layer += self.q_dim + 2 * self.kv_dim
    if self.qk_norm:
      per_layer += 2 * self.head_dim
    total = self.n_layers * per_layer + v * d + d
    if not self.tie_embeddings:
      total += d * v
    return total


_LLAMA31_SCALING = RopeScaling(
  factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _preset(family, vocab, d_model, layers, heads, kv_heads, head_dim, d_ff, max_len, tied, **kw):
  """A released model's shape; q/k/v biases and qk-norm as its family has them."""
  spec = family_spec(family)
  kw.setdefault("rope_theta", 1e6)
  return ModelConfig(
    family=family,
    vocab_size=vocab,
    d_model=d_model,
    n_layers=layers,
    n_heads=heads,
    n_kv_heads=kv_heads,
    head_dim=head_dim,
    d_ff=d_ff,
    max_seq_len=max_len,
    tie_embeddings=tied,
    qkv_bias=spec.qkv_bias,
    qk_norm=spec.qk_norm,
    **kw,
  )


# fmt: off
PRESETS = {
  # name: family, vocab, d_model, layers, heads, kv heads, head_dim, d_ff, max_seq_len, tied
  # CPU-sized: every matrix has at least two 128x128 FP8 blocks per axis.
  "tiny": _preset("qwen3", 128, 256, 2, 4, 2, 64, 512, 2048, False, rope_theta=10000.0),
  "qwen2.5-0.5b": _preset("qwen2", 151936, 896, 24, 14, 2, 64, 4864, 32768, True),
  "qwen2.5-1.5b": _preset("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 131072, True),
  "qwen2.5-7b": _preset("qwen2", 152064, 3584, 28, 28, 4, 128, 18944, 131072, False),
  "qwen3-0.6b": _preset("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 40960, True),
  "qwen3-8b": _preset("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 40960, False),
  # A mixture of experts: 128 experts of width 768, 8 a token (d_ff: config.json's unused
  # intermediate_size).
  "qwen3-30b-a3b": _preset(
    "qwen3_moe", 151936, 2048, 48, 32, 4, 128, 6144, 40960, False,
    n_experts=128, experts_per_token=8, moe_d_ff=768, norm_topk_prob=True,
    router_aux_loss_coef=0.001,
  ),
  "llama-3.1-8b": _preset(
    "llama", 128256, 4096, 32, 32, 8, 128, 14336, 131072, False,
    rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING, rms_eps=1e-5,
  ),
}
# fmt: on


def get_config(name: str) -> ModelConfig:
  """The preset called `name` (case-insensitive); unknown names raise a ValueError."""
  key = name.lower() if isinstance(name, str) else name
  if key not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
  return PRESETS[key]
