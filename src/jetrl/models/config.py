"""Model configuration: a frozen, hashable dataclass (a static `jit` argument) and presets."""

from __future__ import annotations

import dataclasses
from typing import Optional

FAMILIES = ("llama", "qwen2", "qwen3")


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

  family: "llama", "qwen2" (also Qwen2.5) or "qwen3"; it names the checkpoint architecture.
  head_dim is explicit (Qwen3 has n_heads * head_dim != d_model).
  qkv_bias: biases on the q, k, v projections (Qwen2). qk_norm: per-head RMSNorm on q and k
  before RoPE (Qwen3). tie_embeddings: the LM head is the transposed embedding matrix.
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

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"unknown model family {self.family!r}; accepted: {list(FAMILIES)}")
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
    per_layer = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * f + 2 * d
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

PRESETS = {
  # CPU-sized: every matrix has at least two 128x128 FP8 blocks per axis.
  "tiny": ModelConfig(
    family="qwen3",
    vocab_size=128,
    d_model=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    d_ff=512,
    rope_theta=10000.0,
    rms_eps=1e-6,
    tie_embeddings=False,
    qkv_bias=False,
    qk_norm=True,
    max_seq_len=2048,
  ),
  "qwen2.5-0.5b": ModelConfig(
    family="qwen2",
    vocab_size=151936,
    d_model=896,
    n_layers=24,
    n_heads=14,
    n_kv_heads=2,
    head_dim=64,
    d_ff=4864,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    max_seq_len=32768,
  ),
  "qwen2.5-1.5b": ModelConfig(
    family="qwen2",
    vocab_size=151936,
    d_model=1536,
    n_layers=28,
    n_heads=12,
    n_kv_heads=2,
    head_dim=128,
    d_ff=8960,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    max_seq_len=131072,
  ),
  "qwen2.5-7b": ModelConfig(
    family="qwen2",
    vocab_size=152064,
    d_model=3584,
    n_layers=28,
    n_heads=28,
    n_kv_heads=4,
    head_dim=128,
    d_ff=18944,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=False,
    qkv_bias=True,
    max_seq_len=131072,
  ),
  "qwen3-0.6b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    d_model=1024,
    n_layers=28,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    d_ff=3072,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=True,
    qk_norm=True,
    max_seq_len=40960,
  ),
  "qwen3-8b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    d_model=4096,
    n_layers=36,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=12288,
    rope_theta=1e6,
    rms_eps=1e-6,
    tie_embeddings=False,
    qk_norm=True,
    max_seq_len=40960,
  ),
  "llama-3.1-8b": ModelConfig(
    family="llama",
    vocab_size=128256,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    d_ff=14336,
    rope_theta=500000.0,
    rope_scaling=_LLAMA31_SCALING,
    rms_eps=1e-5,
    tie_embeddings=False,
    max_seq_len=131072,
  ),
}


def get_config(name: str) -> ModelConfig:
  """The preset called `name` (case-insensitive); unknown names raise a ValueError."""
  key = name.lower() if isinstance(name, str) else name
  if key not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
  return PRESETS[key]
