"""Model folders on disk: the paths a folder names for its own files (an index's shards), kept
inside the folder, and a folder written beside its place and renamed into it when complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
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


def current_umask() -> int:
  umask = os.umask(0)
  os.umask(umask)
  return umask


@contextlib.contextmanager
def staged_folder(out: str):
  """Yields an empty folder next to `out` to write into; when the block completes, that folder
  replaces `out` (an existing `out` is moved aside, then removed). It has the permissions a
  plain mkdir gives (mkdtemp's 0700 would outlive the rename). On an error it is removed and
  `out` is left as it was. The parent of `out` must exist."""
  parent, name = os.path.dirname(out), os.path.basename(out)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")
  os.chmod(tmp, 0o777 & ~current_umask())
  try:
    yield tmp
    old = None
    if os.path.exists(out):
      old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old-")
      os.replace(out, os.path.join(old, "folder"))
    os.replace(tmp, out)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
