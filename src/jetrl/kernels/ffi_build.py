"""Building jetrl's small C++ XLA FFI handlers (`csrc/`) on first use, cached by content.

Needs a C++ compiler (CXX, else c++ or g++) and jaxlib's FFI headers (`jax.ffi.include_dir()`);
nothing else. Libraries go to JETRL_CACHE_DIR/ffi (default ~/.cache/jetrl/ffi), named by a hash
of the source, the compiler, the flags, the jax version and, for -march=native builds, this
machine's CPU, so a cache shared between machines never loads a library built for another CPU.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import jax


def cache_dir() -> Path:
  root = os.environ.get("JETRL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "jetrl")
  return Path(root) / "ffi"


def compiler() -> Optional[str]:
  return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_tag() -> str:
  """This machine's CPU model and instruction-set flags (what -march=native compiles for)."""
  info = ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("model name", "flags", "Features", "CPU part")):
          info += line
        if line.strip() == "":
          break  # the first processor is enough
  except OSError:
    pass
  return platform.machine() + platform.processor() + info


def build(
  source: Path,
  *,
  defines: tuple[str, ...] = (),
  flags: tuple[str, ...] = ("-O2",),
  out_dir: Optional[Path] = None,
) -> Path:
  """Compile `source` into a shared library (cached by content, compiler, flags and jax).

  Returns the library's path. Raises RuntimeError with the compiler's message on failure.
  """
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
  include = jax.ffi.include_dir()
  text = source.read_bytes()
  key = (cxx, defines, flags, jax.__version__, include)
  if "-march=native" in flags:
    key += (_cpu_tag(),)
  tag = hashlib.sha256(text + repr(key).encode()).hexdigest()
  out_dir = out_dir or cache_dir()
  out = out_dir / f"lib{source.stem}-{tag[:16]}.so"
  if out.exists():
    return out
  out_dir.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [
    cxx,
    *flags,
    "-shared",
    "-fPIC",
    "-std=c++17",
    "-w",
    f"-I{include}",
    *(f"-D{d}" for d in defines),
    str(source),
    "-o",
    tmp,
  ]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
      raise RuntimeError(f"building {source.name} failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent build never sees a partial library
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out
