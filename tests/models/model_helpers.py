"""Shared helpers for the model tests: tiny configs and params, tiny `transformers` reference
models (of any family in `jetrl.models.families`, built from its spec) and tolerances."""

from __future__ import annotations

import jax
import numpy as np

from jetrl import models as M

# The shape of the tiny `transformers` models (`hf_model`), before the overrides.
HF_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
HF_SHAPE.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

LLAMA3_SCALING = dict(
  rope_type="llama3",
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=16,
)


def tiny_config(family: str = "llama", *, vocab: int, d_model: int, heads, d_ff: int, **fields):
  """A small ModelConfig of `family`; heads = (n_heads, n_kv_heads, head_dim). n_layers is 2,
  qkv_bias and qk_norm are the family's (its FamilySpec) unless `fields` set them; a mixture
  of experts' family has 4 experts of width d_ff, 2 a token, unless they do."""
  spec = M.family_spec(family)
  n_heads, n_kv_heads, head_dim = heads
  if spec.moe:
    fields = {"n_experts": 4, "experts_per_token": 2, "moe_d_ff": d_ff, **fields}
  fields = {"n_layers": 2, "qkv_bias": spec.qkv_bias, "qk_norm": spec.qk_norm, **fields}
  return M.ModelConfig(
    family=family,
    vocab_size=vocab,
    d_model=d_model,
    n_heads=n_heads,
    n_kv_heads=n_kv_heads,
    head_dim=head_dim,
    d_ff=d_ff,
    **fields,
  )


def perturbed(params, key, scale: float = 0.1):
  """params + N(0, scale) on every leaf (in its dtype), so that no two tensors are alike."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree_util.tree_unflatten(
    treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  )


def hf_model(family: str, seed: int = 0, noise: float = 0.1, **overrides):
  """A random tiny `transformers` model of `family` (eval mode, float32, eager attention): the
  config class of the spec's model_type, the model class of its architecture.

  Every parameter (norm weights and biases included) is perturbed by N(0, noise) so that a
  mix-up of any two tensors shows in the logits.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  spec = M.family_spec(family)
  kwargs = {**HF_SHAPE, "rms_norm_eps": 1e-6, **overrides}
  torch.manual_seed(seed)
  config = transformers.AutoConfig.for_model(spec.model_type, **kwargs)
  model_cls = getattr(transformers, spec.architecture)
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
