"""The policy model: config and presets, the decoder, KV cache, checkpoint and tokenizer I/O."""

from jetrl.models.cache import KVCache, init_cache, positions_from_mask
from jetrl.models.config import PRESETS, ModelConfig, RopeScaling, get_config
from jetrl.models.families import ARCHITECTURES, FAMILIES, SPECS, FamilySpec, family_spec
from jetrl.models.decoder import forward, forward_cached, hidden_states
from jetrl.models.io.export import export_hf
from jetrl.models.io.hf_io import load_pretrained, save_pretrained
from jetrl.models.logprobs import logprobs_from_hidden, token_logprobs
from jetrl.models.moe import Routing, moe_mlp
from jetrl.models.params import (
  EXPERT_WEIGHTS,
  LINEAR_WEIGHTS,
  check_params,
  init_params,
  param_shapes,
  unstack_layers,
)
from jetrl.models.rollout_weights import (
  fuse_projections,
  prequantize_linear_weights,
  rollout_weights,
)
from jetrl.models.io.hf_tokenizer import (
  HFTokenizer,
  check_vocab,
  generation_eos_ids,
  load_model_tokenizer,
  load_tokenizer,
  stop_ids,
)

__all__ = [
  "ModelConfig",
  "RopeScaling",
  "FAMILIES",
  "FamilySpec",
  "SPECS",
  "family_spec",
  "PRESETS",
  "get_config",
  "init_params",
  "param_shapes",
  "check_params",
  "unstack_layers",
  "forward",
  "hidden_states",
  "token_logprobs",
  "logprobs_from_hidden",
  "KVCache",
  "init_cache",
  "positions_from_mask",
  "forward_cached",
  "ARCHITECTURES",
  "load_pretrained",
  "save_pretrained",
  "HFTokenizer",
  "load_tokenizer",
  "check_vocab",
  "load_model_tokenizer",
  "generation_eos_ids",
  "stop_ids",
  "export_hf",
  "LINEAR_WEIGHTS",
  "EXPERT_WEIGHTS",
  "Routing",
  "moe_mlp",
  "prequantize_linear_weights",
  "fuse_projections",
  "rollout_weights",
]
