"""Model families: everything that tells one checkpoint architecture from another, as data.

A family is one `FamilySpec` in `SPECS` (keyed by `ModelConfig.family`). The config check
(`jetrl.models.config`), the Hugging Face reader and writer (`jetrl.models.io.hf_io`) and the
tests read the spec; none of them branches on a family's name. Adding a family is one entry
here and its case in tests/models/test_model_parity.py (docs/models.md, "Adding a family").
"""

from __future__ import annotations

import dataclasses

SLIDING_WINDOW_RULES = ("none", "flag", "always")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
  """One decoder family as `transformers` writes it.

  name: the `ModelConfig.family` value. architecture / model_type: config.json's
    "architectures"[0] and "model_type".
  qkv_bias, qk_norm: what the family's attention has (ModelConfig fields of the same name;
    a config with other values has no Hugging Face equivalent).
  attention_bias_key: config.json carries "attention_bias" (true is refused, false is written).
  mlp_bias_key: config.json carries "mlp_bias" (written false; true is refused for every family).
  sliding_window: how config.json's "sliding_window" is read (jetrl attends to every earlier
    position): "none" (no such key), "flag" (it applies only with "use_sliding_window", which
    must be false; written as false / null), "always" (it applies whenever set: it must be
    null or at least max_position_embeddings; written as null).
  tie_default: tie_word_embeddings when config.json omits it.
  tensor_names: (params["layers"] name, suffix after "model.layers.{i}.") pairs where the
    family's checkpoint names differ from Llama's.
  moe: every layer's MLP is a mixture of experts (`jetrl.models.moe`: a top-k softmax router
    and SwiGLU experts), its shape from config.json's num_experts, num_experts_per_tok,
    moe_intermediate_size and norm_topk_prob; dense MLP layers among them
    (decoder_sparse_step > 1, mlp_only_layers) are refused.
  """

  name: str
  architecture: str
  model_type: str
  qkv_bias: bool = False
  qk_norm: bool = False
  attention_bias_key: bool = False
  mlp_bias_key: bool = False
  sliding_window: str = "none"
  tie_default: bool = False
  tensor_names: tuple = ()
  moe: bool = False

  def __post_init__(self):
    if self.sliding_window not in SLIDING_WINDOW_RULES:
      raise ValueError(
        f"FamilySpec {self.name!r}: sliding_window {self.sliding_window!r} is not one of "
        f"{list(SLIDING_WINDOW_RULES)}"
      )


SPECS = {
  spec.name: spec
  for spec in (
    FamilySpec(
      name="llama",
      architecture="LlamaForCausalLM",
      model_type="llama",
      attention_bias_key=True,
      mlp_bias_key=True,
    ),
    FamilySpec(
      name="qwen2",
      architecture="Qwen2ForCausalLM",
      model_type="qwen2",
      qkv_bias=True,
      sliding_window="flag",
    ),
    FamilySpec(
      name="qwen3",
      architecture="Qwen3ForCausalLM",
      model_type="qwen3",
      qk_norm=True,
      attention_bias_key=True,
      sliding_window="flag",
    ),
    # Qwen3's attention, every MLP a mixture of experts (Qwen3-30B-A3B, Qwen3-235B-A22B).
    FamilySpec(
      name="qwen3_moe",
      architecture="Qwen3MoeForCausalLM",
      model_type="qwen3_moe",
      qk_norm=True,
      attention_bias_key=True,
      sliding_window="flag",
      moe=True,
    ),
    # Llama's layout; its sliding window must cover every position (or be null).
    FamilySpec(
      name="mistral",
      architecture="MistralForCausalLM",
      model_type="mistral",
      sliding_window="always",
    ),
  )
}
FAMILIES = tuple(SPECS)
# Hugging Face architecture name -> family name.
ARCHITECTURES = {spec.architecture: spec.name for spec in SPECS.values()}


def family_spec(name: str) -> FamilySpec:
  """The spec of family `name`; ValueError naming the accepted families otherwise."""
  if not isinstance(name, str) or name not in SPECS:
    raise ValueError(f"unknown model family {name!r}; accepted: {list(FAMILIES)}")
  return SPECS[name]
