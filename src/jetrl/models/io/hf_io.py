"""Hugging Face checkpoints: config.json <-> ModelConfig, safetensors <-> the params pytree.

Supported architectures: those of the families in `jetrl.models.families` (Llama, Qwen2 /
Qwen2.5, Qwen3, ...); config.json is read and written by `jetrl.models.io.hf_config`. Weights
are read with `safetensors` (numpy), converted to [in, out] and stacked along the layer axis
on the host, then moved to the device in the requested dtype.

Every tensor is checked as it is read: its stored dtype must be a float dtype (an int8 or FP8
tensor would be cast to float silently, scale and all: 0.011 quantized to 11 became 11.0), and
its values finite, before and after the cast to the dtype it is read into (an F64 value above
float32's largest would become Inf); each failure is a ValueError naming the tensor
(docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jetrl.models.config import ModelConfig
from jetrl.models.families import family_spec
from jetrl.models.io.folder_paths import inside_folder
from jetrl.models.io.hf_config import config_from_hf, config_to_hf
from jetrl.models.io.hub import HUB_PATTERNS, hub_folder  # noqa: F401  (HUB_PATTERNS: a public name)
from jetrl.models.params import check_params, param_shapes

# params["layers"] name -> (suffix after "model.layers.{i}.", stored transposed by torch)
_LAYER_TENSORS = {
  "attn_norm": ("input_layernorm.weight", False),
  "wq": ("self_attn.q_proj.weight", True),
  "wk": ("self_attn.k_proj.weight", True),
  "wv": ("self_attn.v_proj.weight", True),
  "wo": ("self_attn.o_proj.weight", True),
  "bq": ("self_attn.q_proj.bias", False),
  "bk": ("self_attn.k_proj.bias", False),
  "bv": ("self_attn.v_proj.bias", False),
  "q_norm": ("self_attn.q_norm.weight", False),
  "k_norm": ("self_attn.k_norm.weight", False),
  "mlp_norm": ("post_attention_layernorm.weight", False),
  "w_gate": ("mlp.gate_proj.weight", True),
  "w_up": ("mlp.up_proj.weight", True),
  "w_down": ("mlp.down_proj.weight", True),
  "router": ("mlp.gate.weight", True),
}
# A mixture of experts' stacked weights [L, E, in, out]: name -> (suffix with {j} the expert).
_EXPERT_TENSORS = {
  "experts_gate": "mlp.experts.{j}.gate_proj.weight",
  "experts_up": "mlp.experts.{j}.up_proj.weight",
  "experts_down": "mlp.experts.{j}.down_proj.weight",
}
_TOP_TENSORS = {
  "embed": ("model.embed_tokens.weight", False),
  "final_norm": ("model.norm.weight", False),
  "lm_head": ("lm_head.weight", True),
}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors dtype names that are read
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "chat_template.json",
  "generation_config.json",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
)


# ---------------------------------------------------------------------------- tensors


def _hf_names(config: ModelConfig) -> dict:
  """{our path (top name, layer name or None): (hf name template, transposed)}."""
  names = {}
  shapes = param_shapes(config)
  renamed = dict(family_spec(config.family).tensor_names)
  for name in shapes:
    if name != "layers":
      names[(name, None)] = _TOP_TENSORS[name]
  for name in shapes["layers"]:
    if name in _EXPERT_TENSORS:  # torch's [out, in] per expert
      names[("layers", name)] = ("model.layers.{i}." + _EXPERT_TENSORS[name], True)
      continue
    suffix, transposed = _LAYER_TENSORS[name]
    names[("layers", name)] = ("model.layers.{i}." + renamed.get(name, suffix), transposed)
  return names


def _layer_names(template: str, i: int, n_experts: int) -> list:
  """The checkpoint names of layer i's slice of a stacked tensor: one, or one per expert."""
  if "{j}" not in template:
    return [template.format(i=i)]
  return [template.format(i=i, j=j) for j in range(n_experts)]


def _target_np_dtype(dtype):
  dtype = jnp.dtype(dtype)
  return ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.dtype(dtype)


def resolve_path(path: str) -> str:
  """A local directory as is; otherwise a hub name: its snapshot in the local hub cache, or
  downloaded there (`jetrl.models.io.hub.hub_folder`)."""
  path = os.path.expanduser(str(path))
  if os.path.isdir(path):
    return path
  if not _HUB_NAME.match(path):
    raise ValueError(
      f"checkpoint directory {path!r} does not exist (and is not a hub name "
      "such as 'Qwen/Qwen2.5-0.5B')"
    )
  return hub_folder(path)


def _weight_files(path: str) -> dict:
  """{tensor name: file} for model.safetensors or a sharded model.safetensors.index.json."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map'")
    return {name: inside_folder(path, file, index) for name, file in weight_map.items()}
  if os.path.exists(single):
    with safe_open(single, framework="np") as f:
      return {name: single for name in f.keys()}
  raise ValueError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


def load_pretrained(path: str, *, dtype=jnp.float32):
  """(ModelConfig, params) from a Hugging Face checkpoint directory or hub name.

  Weights are converted on the host to `dtype` (float32 by default, or bfloat16).
  """
  path = resolve_path(path)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise ValueError(f"{path}: config.json not found")
  with open(cfg_path) as f:
    config = config_from_hf(json.load(f))
  files = _weight_files(path)
  with contextlib.ExitStack() as stack:
    return config, _read_params(config, path, files, stack, dtype)


def _read_params(config: ModelConfig, path: str, files: dict, stack, dtype) -> dict:
  """The params pytree from the checkpoint tensors named in `files`."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  handles = {}

  def get(name: str, shape: tuple, transposed: bool) -> np.ndarray:
    if name not in files:
      raise ValueError(f"checkpoint {path}: missing tensor {name!r}")
    file = files[name]
    if file not in handles:
      handles[file] = stack.enter_context(safe_open(file, framework="np"))
    stored = handles[file].get_slice(name).get_dtype()
    if stored not in FLOAT_DTYPES:
      raise ValueError(
        f"checkpoint {path}: tensor {name!r} is stored as {stored}; accepted: "
        f"{', '.join(FLOAT_DTYPES)} (dequantize integer or FP8 weights first)"
      )
    arr = handles[file].get_tensor(name)
    want = shape[::-1] if transposed else shape
    if tuple(arr.shape) != tuple(want):
      raise ValueError(
        f"checkpoint {path}: tensor {name!r} has shape {tuple(arr.shape)}, "
        f"expected {tuple(want)} from config.json"
      )
    bad = int(np.count_nonzero(~np.isfinite(arr)))
    if bad:
      raise ValueError(
        f"checkpoint {path}: tensor {name!r} holds {bad} non-finite values (NaN or Inf)"
      )
    with np.errstate(over="ignore"):  # counted and reported below
      out = arr.astype(target)
    over = int(np.count_nonzero(~np.isfinite(out.astype(np.float32))))
    if over:  # finite as stored (F64, say), out of range in the dtype it is read into
      raise ValueError(
        f"checkpoint {path}: tensor {name!r} holds {over} values beyond the range of "
        f"{np.dtype(target).name} (largest magnitude {float(np.max(np.abs(arr))):.4g}, stored "
        f"as {stored}); they would become Inf"
      )
    return out.T if transposed else out

  target = _target_np_dtype(dtype)
  shapes = param_shapes(config)
  params, used = {"layers": {}}, set()
  for (top, sub), (template, transposed) in _hf_names(config).items():
    if top != "layers":
      name = template
      params[top] = jnp.asarray(get(name, shapes[top], transposed))
      used.add(name)
      continue
    stacked = np.empty(shapes["layers"][sub], target)
    per_expert = "{j}" in template  # [L, E, in, out]: one tensor per layer and expert
    for i in range(config.n_layers):
      for j, name in enumerate(_layer_names(template, i, config.n_experts)):
        at = (i, j) if per_expert else (i,)
        stacked[at] = get(name, stacked.shape[len(at) :], transposed)
        used.add(name)
    params["layers"][sub] = jnp.asarray(stacked)
  extra = sorted(
    n
    for n in files
    if n not in used
    and not n.endswith(_IGNORED_SUFFIXES)
    and not (config.tie_embeddings and n == "lm_head.weight")
  )
  if extra:
    raise ValueError(
      f"checkpoint {path}: unexpected tensors {extra[:8]}"
      f"{' ...' if len(extra) > 8 else ''} for {family_spec(config.family).architecture}"
    )
  return params


def save_pretrained(
  params, config: ModelConfig, path: str, *, tokenizer_from: Optional[str] = None
) -> str:
  """Write config.json and model.safetensors (in the params' dtype) that `transformers`
  loads; optionally copy the tokenizer files found in directory `tokenizer_from`."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  check_params(params, config)
  dtype = params["embed"].dtype
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for (top, sub), (template, transposed) in _hf_names(config).items():
    if top != "layers":
      arr = np.asarray(jax.device_get(params[top]))
      tensors[template] = np.ascontiguousarray(arr.T if transposed else arr)
      continue
    stacked = np.asarray(jax.device_get(params["layers"][sub]))
    for i in range(config.n_layers):
      for j, name in enumerate(_layer_names(template, i, config.n_experts)):
        arr = stacked[i] if "{j}" not in template else stacked[i, j]
        tensors[name] = np.ascontiguousarray(arr.T if transposed else arr)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(config, dtype), f, indent=2)
  if tokenizer_from is not None:
    for name in TOKENIZER_FILES:
      src = os.path.join(tokenizer_from, name)
      if os.path.exists(src):
        shutil.copy(src, os.path.join(path, name))
  return path
