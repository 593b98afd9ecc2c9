"""Shared helpers for the model tests: tiny `transformers` reference models and tolerances."""

from __future__ import annotations

import numpy as np

HF_CLASSES = {
  "llama": ("LlamaConfig", "LlamaForCausalLM"),
  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

LLAMA3_SCALING = dict(
  rope_type="llama3",
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=16,
)


def hf_model(family: str, seed: int = 0, noise: float = 0.1, **overrides):
  """A random tiny `transformers` model of `family` (eval mode, float32, eager attention).

  Every parameter (norm weights and biases included) is perturbed by N(0, noise) so that a
  mix-up of any two tensors shows in the logits.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  kwargs = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
  )
  kwargs.update(overrides)
  cfg_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[family])
  torch.manual_seed(seed)
  config = cfg_cls(**kwargs)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  model = model_cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(noise * torch.randn_like(p))
  return model


def hf_logits(model, tokens, attention_mask=None, position_ids=None) -> np.ndarray:
  import torch  # pylint: disable=import-outside-toplevel

  kw = {}
  if attention_mask is not None:
    kw["attention_mask"] = torch.tensor(np.asarray(attention_mask), dtype=torch.long)
  if position_ids is not None:
    kw["position_ids"] = torch.tensor(np.asarray(position_ids), dtype=torch.long)
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long), **kw).logits.numpy()


def rel_err(got, want, where=None) -> float:
  """max |got - want| / max |want| (over `where` when given)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if where is not None:
    got, want = got[np.asarray(where, bool)], want[np.asarray(where, bool)]
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
