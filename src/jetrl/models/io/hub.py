"""Hugging Face hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) as model folders.

`hub_folder(repo_id)` is the folder of the model's snapshot in the local hub cache, the one
`huggingface_hub` (and `transformers`) keep: `<cache>/models--<org>--<name>/snapshots/<commit>/`,
the commit named by `refs/main`. The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`, read when the call is made. A model already there is used without
the network; one that is not is downloaded there (config, safetensors weights, tokenizer and
template files: `HUB_PATTERNS`) unless `HF_HUB_OFFLINE=1`. What fails is a ValueError that says
where it looked and how to get the model there.
"""

from __future__ import annotations

import os
import re
from typing import Optional

# "org/name": an id of the hub (a bare name is a preset or a folder to the command line).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def is_hub_id(name: str) -> bool:
  """`org/name` that is not a local path (a folder of that name wins)."""
  return isinstance(name, str) and bool(HUB_ID.match(name)) and not os.path.exists(name)


def hub_cache() -> str:
  """The hub cache folder as `huggingface_hub` finds it now (HF_HUB_CACHE, HF_HOME)."""
  if os.environ.get("HF_HUB_CACHE"):
    return os.path.expanduser(os.environ["HF_HUB_CACHE"])
  home = os.environ.get("HF_HOME") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
  )
  return os.path.join(os.path.expanduser(home), "hub")


def _offline() -> bool:
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_folder(repo_id: str, revision: Optional[str] = None) -> Optional[str]:
  """The cached snapshot of `repo_id` (with a config.json), or None; no network."""
  from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel

  try:
    path = snapshot_download(
      repo_id=repo_id,
      revision=revision,
      cache_dir=hub_cache(),
      allow_patterns=HUB_PATTERNS,
      local_files_only=True,
    )
  except Exception:  # pylint: disable=broad-except  # not cached (its error types vary by version)
    return None
  return path if os.path.isfile(os.path.join(path, "config.json")) else None


def hub_folder(repo_id: str, revision: Optional[str] = None) -> str:
  """The local folder of hub model `repo_id`: the cached snapshot, or downloaded into the
  cache; ValueError saying where it looked and how to fetch it."""
  path = cached_folder(repo_id, revision)
  if path is not None:
    return path
  cache = hub_cache()
  fetch = (
    f"fetch it where the network allows (`huggingface-cli download {repo_id}`, or "
    f"huggingface_hub.snapshot_download({repo_id!r})) into that cache, set HF_HUB_CACHE / "
    "HF_HOME to a cache that has it, or pass a local model folder"
  )
  if _offline():
    raise ValueError(
      f"{repo_id!r} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set; {fetch}"
    )
  from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel

  try:
    path = snapshot_download(
      repo_id=repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_PATTERNS
    )
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
      f"{repo_id!r} is not in the Hugging Face cache {cache} and could not be downloaded "
      f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); {fetch}"
    ) from None
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ValueError(f"hub model {repo_id!r} has no config.json (in {path})")
  return path
