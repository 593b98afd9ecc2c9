"""A model folder is data: its index may not send the reader outside the folder."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jetrl import models as M

CONFIG = M.ModelConfig(
  family="qwen3",
  vocab_size=32,
  d_model=32,
  n_layers=1,
  n_heads=2,
  n_kv_heads=1,
  head_dim=16,
  d_ff=48,
  qk_norm=True,
)


@pytest.fixture()
def sharded(tmp_path):
  """A folder whose weights are one shard named by model.safetensors.index.json, and a copy
  of the same weights in a folder beside it (what a hostile index points at)."""
  folder = tmp_path / "model"
  params = M.init_params(CONFIG, jax.random.PRNGKey(0))
  M.save_pretrained(params, CONFIG, str(folder))
  tensors = load_file(str(folder / "model.safetensors"))
  os.remove(folder / "model.safetensors")
  save_file(tensors, str(folder / "shard-1.safetensors"))
  other = tmp_path / "other"
  other.mkdir()
  shutil.copy(folder / "shard-1.safetensors", other / "model.safetensors")

  def write_index(file):
    (folder / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {name: file for name in tensors}})
    )

  return folder, other, write_index, tensors


def test_an_index_inside_the_folder_loads(sharded):
  folder, _, write_index, tensors = sharded
  write_index("shard-1.safetensors")
  _, params = M.load_pretrained(str(folder))
  np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize(
  "entry",
  [
    "../other/model.safetensors",
    "sub/../../other/model.safetensors",
    "ABSOLUTE",
    "",
    7,
  ],
)
def test_an_index_entry_outside_the_folder_is_refused(sharded, entry):
  folder, other, write_index, _ = sharded
  if entry == "ABSOLUTE":
    entry = str(other / "model.safetensors")
  write_index(entry)
  with pytest.raises(ValueError, match=r"model.safetensors.index.json: weight_map entry"):
    M.load_pretrained(str(folder))
