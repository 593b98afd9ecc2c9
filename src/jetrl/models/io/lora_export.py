"""A LoRA run's adapters as a PEFT adapter folder: adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, folder)` loads onto the
Hugging Face base model (the folder `export_hf` writes from the run's base, or the one the run
started from).

PEFT's LoRA layer computes base(x) + lora_B(lora_A(x)) * lora_alpha / r; its lora_A.weight is
torch's [r, in] and lora_B.weight [out, r]: jetrl's a [in, r] and b [r, out] transposed. The
folder is written next to `out` and renamed into place when complete (`staged_folder`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import numpy as np

from jetrl.models.config import ModelConfig
from jetrl.models.io.folder_paths import check_replaceable, current_umask, staged_folder
from jetrl.models.lora import HF_MODULES, LoraConfig, check_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY = "base_model.model.model.layers.{i}.{module}.lora_{part}.weight"


def peft_config(cfg: LoraConfig, base_model: Optional[str]) -> dict:
  """adapter_config.json for these adapters (plain LoRA: no dropout, no bias, no rsLoRA)."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model,
    "r": cfg.rank,
    "lora_alpha": cfg.alpha,
    "lora_dropout": 0.0,
    "target_modules": sorted(HF_MODULES[w].split(".")[-1] for w in cfg.weights),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "modules_to_save": None,
    "inference_mode": True,
  }


def adapter_tensors(adapters, config: ModelConfig, cfg: LoraConfig) -> dict:
  """{safetensors name: float32 [r, in] or [out, r] array} of every layer's adapters."""
  check_adapters(adapters, config, cfg)
  out = {}
  for name in cfg.weights:
    a = np.asarray(jax.device_get(adapters[name]["a"]), np.float32)  # [L, in, r]
    b = np.asarray(jax.device_get(adapters[name]["b"]), np.float32)  # [L, r, out]
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
      raise ValueError(f"export: the {name} adapters hold NaN or Inf; refusing to write them")
    for i in range(config.n_layers):
      key = lambda part, i=i: KEY.format(i=i, module=HF_MODULES[name], part=part)
      out[key("A")] = np.ascontiguousarray(a[i].T)
      out[key("B")] = np.ascontiguousarray(b[i].T)
  return out


def export_peft(
  adapters,
  config: ModelConfig,
  cfg: LoraConfig,
  out: str,
  *,
  base_model: Optional[str] = None,
  overwrite: bool = False,
) -> str:
  """Write `adapters` as a PEFT adapter folder at `out`; returns its path.

  base_model: recorded as `base_model_name_or_path` (the folder or hub name of the base).
  overwrite: replace an existing non-empty `out` that an earlier export wrote and that holds
    nothing else (otherwise a ValueError naming what is in the way).
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  tensors = adapter_tensors(adapters, config, cfg)
  out = os.path.abspath(os.path.expanduser(out))
  check_replaceable(out, overwrite)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with staged_folder(out, export=True) as tmp:
    save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
      json.dump(peft_config(cfg, base_model), f, indent=2)
    umask = current_umask()
    for name in os.listdir(tmp):  # safetensors writes its file owner-only (0600)
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
  return out
