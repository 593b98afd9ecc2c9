"""Model folders on disk: the paths a folder names for its own files (an index's shards), kept
inside the folder, and a folder written beside its place and renamed into it when complete.

An export's folder holds a marker (`EXPORT_MARKER`) listing the files it wrote. Replacing an
existing folder (`overwrite`) is allowed only for such a folder holding nothing else
(`check_replaceable`): an `--out` naming a run's workdir, or the folder around it, once had
the run's checkpoints, metrics and plots deleted by the export."""

from __future__ import annotations

import contextlib
import json
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


EXPORT_MARKER = ".jetrl-export.json"  # {"written_by": "jetrl export", "files": [...]}


def exported_files(folder: str) -> "list[str] | None":
  """The files an export wrote in `folder`, as its marker lists them; None without a marker."""
  path = os.path.join(folder, EXPORT_MARKER)
  if os.path.islink(path) or not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      files = json.load(f).get("files")
  except (OSError, ValueError, AttributeError):
    return None
  if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
    return None
  return files


def check_replaceable(out: str, overwrite: bool) -> None:
  """ValueError unless an export may write `out`: missing, an empty folder, or, with
  `overwrite`, a folder an earlier export wrote (its marker there) that holds only the files
  that export wrote. A link is refused (the export replaces names, not what they point to)."""
  if os.path.islink(out):
    raise ValueError(f"export: {out} is a symbolic link; give the folder itself")
  if not os.path.lexists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f"export: {out} is a file; give a directory")
  present = sorted(os.listdir(out))
  if not present:
    return
  if not overwrite:
    raise ValueError(
      f"export: {out} exists and is not empty; pass overwrite=True to replace an earlier "
      "export's folder, or choose another folder"
    )
  files = exported_files(out)
  if files is None:
    raise ValueError(
      f"export: {out} was not written by an export (no {EXPORT_MARKER} in it); overwrite "
      "replaces only an earlier export's folder: choose another folder, or empty it yourself"
    )
  foreign = [n for n in present if n not in files and n != EXPORT_MARKER]
  if foreign:
    raise ValueError(
      f"export: {out} holds files the earlier export did not write: {foreign[:8]}"
      f"{' ...' if len(foreign) > 8 else ''}; overwrite would delete them: move them out, "
      "or choose another folder"
    )


@contextlib.contextmanager
def staged_folder(out: str, *, export: bool = False):
  """Yields an empty folder next to `out` to write into; when the block completes, that folder
  replaces `out` (an existing `out` is moved aside, then removed), with (`export`) a marker
  listing its files (`EXPORT_MARKER`). It has the permissions a
  plain mkdir gives (mkdtemp's 0700 would outlive the rename). On an error it is removed and
  `out` is left as it was. The parent of `out` must exist."""
  parent, name = os.path.dirname(out), os.path.basename(out)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")
  os.chmod(tmp, 0o777 & ~current_umask())
  try:
    yield tmp
    if export:
      marker = {"written_by": "jetrl export", "files": sorted(os.listdir(tmp))}
      with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
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
