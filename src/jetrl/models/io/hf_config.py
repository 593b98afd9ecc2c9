"""Hugging Face config.json <-> ModelConfig, for every family in `jetrl.models.families`.

What differs between families (the architecture name, q/k/v biases, qk-norm, which keys
config.json carries, how a sliding window is read) comes from the family's `FamilySpec`;
what config.json may hold that jetrl cannot run (another activation or rope type, a partial
rotary factor, MLP biases, a sliding window that hides positions) is a ValueError naming it.
"""

from __future__ import annotations

import jax.numpy as jnp

from jetrl.models.config import ModelConfig, RopeScaling
from jetrl.models.families import ARCHITECTURES, SPECS, FamilySpec, family_spec

_BY_MODEL_TYPE = {spec.model_type: spec for spec in SPECS.values()}


def _rope_from_hf(cfg: dict):
  """(rope_theta, RopeScaling or None) from legacy (rope_theta / rope_scaling) or
  transformers-5 style (rope_parameters) fields."""
  params = cfg.get("rope_parameters") or {}
  scaling = cfg.get("rope_scaling") or {}
  if params and all(isinstance(v, dict) for v in params.values()):
    raise ValueError("config.json: per-layer rope_parameters are not supported")
  theta = params.get("rope_theta", cfg.get("rope_theta", scaling.get("rope_theta", 10000.0)))
  spec = scaling or params
  kind = spec.get("rope_type", spec.get("type", "default"))
  if spec.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
  if kind == "default":
    return float(theta), None
  if kind != "llama3":
    raise ValueError(
      f"config.json: rope type {kind!r} is not supported; accepted: 'default', 'llama3'"
    )
  try:
    rs = RopeScaling(
      factor=float(spec["factor"]),
      low_freq_factor=float(spec["low_freq_factor"]),
      high_freq_factor=float(spec["high_freq_factor"]),
      original_max_position_embeddings=int(
        spec.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
      ),
    )
  except (KeyError, TypeError) as e:
    raise ValueError(f"config.json: llama3 rope scaling is missing field {e}") from None
  return float(theta), rs


def _check_window(spec: FamilySpec, cfg: dict) -> None:
  """A sliding window that would hide an earlier position is refused (jetrl attends to all)."""
  window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
  covers = isinstance(window, int) and not isinstance(window, bool) and window >= positions
  if spec.sliding_window == "always" and window is not None and not covers:
    raise ValueError(
      f"config.json: sliding_window={window} < max_position_embeddings={positions} is not "
      f"supported for {spec.architecture} (jetrl attends to every earlier position); "
      "set sliding_window to null or to at least max_position_embeddings"
    )


def _int_key(cfg: dict, *keys):
  for key in keys:
    if cfg.get(key) is not None:
      return int(cfg[key])
  raise ValueError(f"config.json: missing field {keys[0]!r}")


def _moe_from_hf(spec: FamilySpec, cfg: dict) -> dict:
  """The ModelConfig fields of a mixture of experts (spec.moe), every layer one: a dense MLP
  layer among them (decoder_sparse_step > 1, mlp_only_layers) is refused."""
  if not spec.moe:
    return {}
  step = cfg.get("decoder_sparse_step", 1)
  only = cfg.get("mlp_only_layers") or []
  if step != 1 or only:
    raise ValueError(
      f"config.json: decoder_sparse_step={step!r}, mlp_only_layers={only!r}: dense MLP layers "
      f"among the mixture-of-experts layers are not supported for {spec.architecture}; "
      "accepted: decoder_sparse_step 1 and mlp_only_layers empty (every layer a mixture)"
    )
  experts = _int_key(cfg, "num_experts", "num_local_experts")
  if experts < 1:
    raise ValueError(
      f"config.json: num_experts must be >= 1 for {spec.architecture}, got {experts}"
    )
  return dict(
    n_experts=experts,
    experts_per_token=_int_key(cfg, "num_experts_per_tok"),
    moe_d_ff=_int_key(cfg, "moe_intermediate_size"),
    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
  )


def config_from_hf(cfg: dict) -> ModelConfig:
  """ModelConfig from a parsed Hugging Face config.json; ValueError on what is unsupported."""
  archs = cfg.get("architectures") or []
  arch = archs[0] if archs else None
  if arch is None:
    by_type = _BY_MODEL_TYPE.get(cfg.get("model_type"))
    arch = by_type.architecture if by_type else cfg.get("model_type")
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"config.json: unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
    )
  spec = SPECS[ARCHITECTURES[arch]]
  act = cfg.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported; accepted: 'silu'")
  if spec.attention_bias_key and cfg.get("attention_bias", False):
    raise ValueError(f"config.json: attention_bias=true is not supported for {arch}")
  if cfg.get("mlp_bias", False):
    raise ValueError("config.json: mlp_bias=true is not supported")
  if cfg.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=true is not supported")
  _check_window(spec, cfg)
  for key in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
  ):
    if key not in cfg:
      raise ValueError(f"config.json: missing field {key!r}")
  n_heads = int(cfg["num_attention_heads"])
  theta, scaling = _rope_from_hf(cfg)
  return ModelConfig(
    family=spec.name,
    vocab_size=int(cfg["vocab_size"]),
    d_model=int(cfg["hidden_size"]),
    n_layers=int(cfg["num_hidden_layers"]),
    n_heads=n_heads,
    n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
    head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
    d_ff=int(cfg["intermediate_size"]),
    rope_theta=theta,
    rope_scaling=scaling,
    rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    tie_embeddings=bool(cfg.get("tie_word_embeddings", spec.tie_default)),
    qkv_bias=spec.qkv_bias,
    qk_norm=spec.qk_norm,
    max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
    **_moe_from_hf(spec, cfg),
  )


def config_to_hf(config: ModelConfig, dtype) -> dict:
  """A Hugging Face config.json dict for `config`; ValueError if the architecture cannot
  express it (its qkv_bias and qk_norm must be the family's: qwen2 needs qkv biases, qwen3
  needs qk-norm, llama has neither)."""
  spec = family_spec(config.family)
  if (config.qkv_bias, config.qk_norm) != (spec.qkv_bias, spec.qk_norm):
    raise ValueError(
      f"ModelConfig(family={config.family!r}, qkv_bias={config.qkv_bias}, "
      f"qk_norm={config.qk_norm}) has no Hugging Face equivalent; {config.family} needs "
      f"qkv_bias={spec.qkv_bias}, qk_norm={spec.qk_norm}"
    )
  rope = {"rope_type": "default", "rope_theta": config.rope_theta}
  legacy_scaling = None
  if config.rope_scaling is not None:
    rs = config.rope_scaling
    legacy_scaling = {
      "rope_type": "llama3",
      "factor": rs.factor,
      "low_freq_factor": rs.low_freq_factor,
      "high_freq_factor": rs.high_freq_factor,
      "original_max_position_embeddings": rs.original_max_position_embeddings,
    }
    rope = dict(legacy_scaling, rope_theta=config.rope_theta)
  dtype_name = jnp.dtype(dtype).name
  out = {
    "architectures": [spec.architecture],
    "model_type": spec.model_type,
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.d_ff,
    "num_hidden_layers": config.n_layers,
    "num_attention_heads": config.n_heads,
    "num_key_value_heads": config.n_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": config.max_seq_len,
    "rms_norm_eps": config.rms_eps,
    "rope_theta": config.rope_theta,
    "rope_scaling": legacy_scaling,
    "rope_parameters": rope,
    "tie_word_embeddings": config.tie_embeddings,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": dtype_name,
    "dtype": dtype_name,
  }
  if spec.attention_bias_key:
    out["attention_bias"] = False
  if spec.mlp_bias_key:
    out["mlp_bias"] = False
  if spec.sliding_window == "flag":
    out["use_sliding_window"] = False
  if spec.sliding_window != "none":
    out["sliding_window"] = None
  if spec.moe:
    out.update(
      num_experts=config.n_experts,
      num_experts_per_tok=config.experts_per_token,
      moe_intermediate_size=config.moe_d_ff,
      norm_topk_prob=config.norm_topk_prob,
      router_aux_loss_coef=config.router_aux_loss_coef,
      decoder_sparse_step=1,
      mlp_only_layers=[],
      output_router_logits=False,
    )
  return out
