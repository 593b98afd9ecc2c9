"""A policy's params -> a Hugging Face folder that `transformers` loads and generates from.

Why: a trained policy leaves jetrl as a folder other tools read. `export_hf` is
`save_pretrained` (config.json and model.safetensors) with what an export needs around it:

- the params are checked against the config and for NaN / Inf (nothing non-finite is written,
  docs/reliability.md), and optionally cast (`dtype="bfloat16"` halves the folder);
- the tokenizer files of `tokenizer_from` (the folder the run's tokenizer came from) are copied,
  after checking that the tokenizer fits the model's vocabulary, with a generation_config.json
  naming its end-of-generation ids when that folder has none, so `generate` stops where jetrl's
  sampler stops;
- the folder is written next to `out` and renamed into place when complete; an existing
  non-empty `out` is refused unless `overwrite=True` and it is an earlier export's folder
  holding nothing else (`folder_paths.check_replaceable`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.models.config import ModelConfig
from jetrl.models.io.folder_paths import check_replaceable, current_umask, staged_folder
from jetrl.models.io.hf_io import resolve_path, save_pretrained
from jetrl.models.params import check_params
from jetrl.models.io.hf_tokenizer import load_tokenizer

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def _check_finite(params) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    bad = int(np.count_nonzero(~np.isfinite(np.asarray(jax.device_get(leaf), np.float32))))
    if bad:
      raise ValueError(
        f"export: params{jax.tree_util.keystr(path)} holds {bad} non-finite "
        "values (NaN or Inf); refusing to write them"
      )


def export_hf(
  params,
  config: ModelConfig,
  out: str,
  *,
  tokenizer_from: Optional[str] = None,
  dtype: Optional[str] = None,
  overwrite: bool = False,
) -> str:
  """Write `params` as a Hugging Face folder at `out`; returns its path.

  tokenizer_from: a checkpoint folder (or hub name) whose tokenizer files, chat template and
    generation config are copied (checked against `config` first).
  dtype: "float32", "bfloat16" or "float16" to cast the weights to; None keeps their dtype.
  overwrite: replace an existing non-empty `out` that an earlier export wrote and that holds
    nothing else (otherwise a ValueError naming what is in the way).
  """
  check_params(params, config)
  if dtype is not None and str(dtype) not in EXPORT_DTYPES:
    raise ValueError(
      f"export: dtype {dtype!r} is not accepted; choose one of "
      f"{list(EXPORT_DTYPES)} or None (keep the params' dtype)"
    )
  _check_finite(params)
  if dtype is not None:
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a).astype(jnp.dtype(dtype)), params)
  tok = None
  if tokenizer_from is not None:
    tokenizer_from = resolve_path(tokenizer_from)
    tok = load_tokenizer(tokenizer_from, config=config)
  out = os.path.abspath(os.path.expanduser(out))
  check_replaceable(out, overwrite)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with staged_folder(out, export=True) as tmp:
    save_pretrained(params, config, tmp, tokenizer_from=tokenizer_from)
    umask = current_umask()
    for name in os.listdir(tmp):  # safetensors writes its file owner-only (0600)
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    gen_path = os.path.join(tmp, "generation_config.json")
    if tok is not None and not os.path.exists(gen_path) and tok.eos_token_ids:
      gen = {"eos_token_id": list(tok.eos_token_ids)}
      if tok.bos_token_id is not None:
        gen["bos_token_id"] = tok.bos_token_id
      if tok.pad_token_id is not None:
        gen["pad_token_id"] = tok.pad_token_id
      with open(gen_path, "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
  return out
