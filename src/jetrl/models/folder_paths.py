"""Paths a model folder names for its own files (an index's shards), kept inside the folder."""

from __future__ import annotations

import os
from typing import Any


def inside_folder(folder: str, file: Any, index: str) -> str:
  """`folder/file` when the index entry `file` names a file inside `folder`; ValueError
  otherwise (`../other/model.safetensors`, an absolute path). The check is on the name: the
  hub's cache links a snapshot's files to blobs beside it, which is where they belong."""
  root = os.path.normpath(os.path.abspath(folder))
  if not isinstance(file, str) or not file or os.path.isabs(file):
    raise ValueError(
      f"{index}: weight_map entry {file!r} must be a file name relative to the model folder"
    )
  target = os.path.normpath(os.path.join(root, file))
  if os.path.commonpath([root, target]) != root or target == root:
    raise ValueError(
      f"{index}: weight_map entry {file!r} points outside the model folder {folder!r}; "
      "every shard must be a file inside it"
    )
  return os.path.join(folder, file)
