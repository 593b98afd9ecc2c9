"""Blockwise FP8 GEMMs through cuBLASLt on Hopper, as an XLA FFI custom call.

cuBLASLt (12.9 and later) runs FP8 GEMMs with exactly jetrl's scaling: 1x128 groups along the
contraction axis (its VEC128_32F scale mode) on one or both operands and 128x128 blocks
(BLK128x128_32F) on a weight, promoting each 128-product block to float32 (docs/numerics.md,
"The GPU GEMMs and their tolerance"). This module builds the small C++ handler in `csrc/` on
first use (a C++ compiler and jaxlib's FFI headers; no CUDA headers or libraries at build
time), loads it next to the cuBLASLt that XLA itself uses, registers it with XLA, and checks it
once against the XLA path on a small problem before anything uses it.

  gemm(a, a_scale, b, b_scale, b_blocks=..., out_dtype=...)
    a [P, C], b [Q, C]: FP8, contiguous along C;  a_scale [P, ceil(C/128)] float32;
    b_scale [Q, ceil(C/128)] (1x128 groups) or [ceil(Q/128), ceil(C/128)] (b_blocks=True)
    -> out [P, Q] = sum_kb a_scale[p, kb] b_scale[q(, /128), kb] (a[p, kb] . b[q, kb])

`unavailable_reason()` says why the GEMM cannot run here (no GPU, not Hopper, no compiler,
cuBLASLt too old, the self-check failed): the backend selection (jetrl.kernels.backend)
falls back to the Pallas kernel or to XLA and says so. Nothing here runs, or is imported from
CUDA, on a machine without a GPU: `pip install` and the CPU tests never need it.

Environment: JETRL_CACHE_DIR (where the built library is kept; default ~/.cache/jetrl),
CXX (the compiler; default c++ or g++). `--kernels.cublaslt_graphs=false`
(`KernelConfig.cublaslt_graphs`, jetrl.kernels.device; default from JETRL_CUBLASLT_GRAPHS) keeps
the call out of XLA's CUDA graphs; the handler is registered once a process, with the setting
of the first plan that runs it (a later plan's other setting is said once, not applied).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels.ffi_build import build, cache_dir, compiler  # noqa: F401 (re-exported)
from jetrl.precision.formats import E4M3, E5M2
from jetrl.kernels import partition
from jetrl.kernels.device import KernelConfig

SOURCE = Path(__file__).parent / "csrc" / "fp8_blockwise_gemm.cc"
TARGET = "jetrl_fp8_blockwise_gemm"
WORKSPACE_BYTES = 32 << 20
MIN_CUBLASLT_VERSION = 120900
BLOCK = 128
# The tensor cores sum each 128-product block at their own accumulation precision before the
# float32 promotion: ~2e-4 relative on an H200; a wrong operand or scale layout gives O(1).
SELF_CHECK_TOL = 2e-3
# dtype codes shared with the C++ handler.
DTYPE_CODES = {
  np.dtype(E4M3): 0,
  np.dtype(E5M2): 1,
  np.dtype(jnp.bfloat16): 2,
  np.dtype(jnp.float32): 3,
}


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _round_up(a: int, b: int) -> int:
  return _cdiv(a, b) * b


def _cublaslt_candidates() -> list[str]:
  """Places libcublasLt may be: the NVIDIA wheels next to jaxlib / torch, CUDA_HOME, sonames."""
  found = []
  for base in sys.path:
    for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cu12/lib"):
      found += sorted(glob.glob(os.path.join(base, sub, "libcublasLt.so*")), reverse=True)
  for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if home:
      found += sorted(glob.glob(os.path.join(home, "lib64", "libcublasLt.so*")), reverse=True)
  return found + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]


def _load_cublaslt() -> str:
  """Make libcublasLt's symbols global in this process; returns which one (XLA's if loaded)."""
  mode = os.RTLD_GLOBAL
  for soname in ("libcublasLt.so.13", "libcublasLt.so.12"):
    try:  # XLA's own, already in the process
      ctypes.CDLL(soname, mode=mode | os.RTLD_NOLOAD)
      return soname + " (already loaded)"
    except OSError:
      pass
  errors = []
  for cand in _cublaslt_candidates():
    try:
      ctypes.CDLL(cand, mode=mode)
      return cand
    except OSError as e:
      errors.append(str(e))
  raise RuntimeError("libcublasLt not found: " + "; ".join(errors[-3:]))


def _gpu_reason() -> Optional[str]:
  try:
    if jax.default_backend() != "gpu":
      return f"no GPU (JAX backend {jax.default_backend()!r})"
    dev = jax.devices()[0]
  except RuntimeError as e:
    return f"no GPU ({e})"
  if "NVIDIA" not in getattr(dev, "device_kind", "") and not hasattr(dev, "compute_capability"):
    return f"not an NVIDIA GPU ({dev.device_kind})"
  cc = str(getattr(dev, "compute_capability", "0"))
  if not cc.startswith("9."):
    return (
      f"cuBLASLt's 1x128 / 128x128 FP8 scaling runs on compute capability 9.x (Hopper); "
      f"this GPU has {cc}"
    )
  return None


class _State:
  lib = None
  reason: Optional[str] = "not loaded yet"
  info: dict = {}
  compile_only = False  # registered for compiling only (`load_for_compile`): never runs


def load_for_compile(graphs: bool = True) -> Optional[str]:
  """Register the real handler for CUDA in a process that only compiles for a Hopper GPU it
  does not have (`jetrl.aot`): the library is built as for a GPU and loaded lazily, so its
  cuBLASLt calls stay unresolved (it is never executed here, and no CUDA library is needed).
  cuBLASLt is not here to be asked which shapes it has an algorithm for: every shape counts
  as supported (on the H200 runs in docs/device every GEMM shape of the product was).
  graphs: whether the handler may be captured in CUDA graphs (`KernelConfig.cublaslt_graphs`).
  None when registered, else why not."""
  if _State.lib is not None:
    _check_graphs(graphs)
    return None
  try:
    path = build(SOURCE)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LAZY)
    _register(lib, "CUDA", graphs)
  except Exception as e:  # pylint: disable=broad-except
    _State.reason = f"{type(e).__name__}: {e}"
    return _State.reason
  _State.lib, _State.reason, _State.compile_only = lib, None, True
  _State.info.update(library=str(path), compile_only=True)
  unavailable_reason.cache_clear()
  supported.cache_clear()
  return None


def _register(lib, platform: str, graphs: bool) -> None:
  symbol = lib.JetrlFp8BlockwiseGemmGraph if graphs else lib.JetrlFp8BlockwiseGemm
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(symbol), platform=platform)
  _State.info["cuda_graphs"] = graphs


def _check_graphs(graphs: bool) -> None:
  """Say (once) that a plan asks for the other CUDA-graph setting than the handler has."""
  registered = _State.info.get("cuda_graphs")
  if registered is not None and registered != graphs:
    _say_once(
      f"the cuBLASLt handler is registered with cublaslt_graphs={registered} (once a process); "
      f"this plan's cublaslt_graphs={graphs} is not applied"
    )


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
  logging.getLogger("jetrl").warning("jetrl: %s", message)


def _configure(lib) -> None:
  lib.jetrl_cublaslt_version.restype = ctypes.c_size_t
  lib.jetrl_cublaslt_supported.restype = ctypes.c_int
  lib.jetrl_cublaslt_supported.argtypes = [
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_uint64,
    ctypes.c_char_p,
    ctypes.c_int,
  ]


def load(
  graphs: Optional[bool] = None,
  *,
  _platform: str = "CUDA",
  _library: Optional[Path] = None,
  _skip_gpu_check: bool = False,
) -> Optional[str]:
  """Build, load, register and self-check the GEMM once; None when usable, else why not.
  graphs: whether the handler may be captured in CUDA graphs (`KernelConfig.cublaslt_graphs`;
  None: the environment's, `KernelConfig.from_env`).

  The keyword arguments exist for the CPU tests, which load the handler against a host-side
  stand-in for cuBLASLt.
  """
  if graphs is None:
    graphs = KernelConfig.from_env().cublaslt_graphs
  if _State.lib is not None:
    _check_graphs(graphs)
    return None
  try:
    if not _skip_gpu_check:
      reason = _gpu_reason()
      if reason:
        _State.reason = reason
        return reason
      _State.info["cublaslt"] = _load_cublaslt()
    path = _library or build(SOURCE)
    lib = ctypes.CDLL(str(path))
    _configure(lib)
    version = int(lib.jetrl_cublaslt_version())
    _State.info.update(library=str(path), cublaslt_version=version)
    if version < MIN_CUBLASLT_VERSION:
      _State.reason = (
        f"cuBLASLt {version} is older than {MIN_CUBLASLT_VERSION}, the first "
        "with 1x128 / 128x128 FP8 scaling"
      )
      return _State.reason
    _register(lib, _platform, graphs)
    _State.lib = lib
    _State.reason = None
    problem = self_check()
    if problem:
      _State.lib, _State.reason = None, f"self-check failed: {problem}"
  except Exception as e:  # pylint: disable=broad-except
    _State.lib, _State.reason = None, f"{type(e).__name__}: {e}"
  return _State.reason


@functools.lru_cache(maxsize=None)
def unavailable_reason(graphs: Optional[bool] = None) -> Optional[str]:
  """Why the cuBLASLt GEMM cannot run in this process (None if it can); decided once (`load`:
  the handler registered with the first caller's `graphs`)."""
  if _State.compile_only:
    if graphs is not None:
      _check_graphs(graphs)
    return None
  return load(graphs)


def info() -> dict:
  """What was loaded: library paths, cuBLASLt version, whether CUDA graphs may record it."""
  return dict(_State.info, reason=_State.reason)


@functools.lru_cache(maxsize=4096)
def supported(p: int, q: int, c: int, a_dtype, b_dtype, out_dtype, b_blocks: bool) -> bool:
  """Whether cuBLASLt has an algorithm for this (padded) problem; asked once per shape."""
  if _State.lib is None:
    return False
  codes = [DTYPE_CODES.get(np.dtype(d)) for d in (a_dtype, b_dtype, out_dtype)]
  if None in codes or codes[0] > 1 or codes[1] > 1 or codes[2] < 2:
    return False
  if _State.compile_only:
    return True
  pp, qp, cp = _padded(p, q, c)
  err = ctypes.create_string_buffer(256)
  ok = _State.lib.jetrl_cublaslt_supported(
    pp,
    qp,
    cp,
    codes[0],
    codes[1],
    codes[2],
    int(b_blocks),
    _block_ld(cp),
    WORKSPACE_BYTES,
    err,
    len(err),
  )
  return bool(ok)


def _padded(p: int, q: int, c: int) -> tuple[int, int, int]:
  """Padded sizes: rows to a multiple of 16, the contraction to whole 128-blocks."""
  return _round_up(max(p, 1), 16), _round_up(max(q, 1), 16), _round_up(max(c, 1), BLOCK)


def _block_ld(c: int) -> int:
  """Leading dimension of a 128x128 block-scale array: K-blocks, rounded up to 4 (16 bytes)."""
  return _round_up(_cdiv(c, BLOCK), 4)


def scale_padding(k: int) -> int:
  """Columns of 1.0 that a K-major weight's 128x128 block scales [N/128, ceil(K/128)] take
  to reach the leading dimension `gemm_t` reads them with (0 when they already do)."""
  return _block_ld(_padded(1, 1, k)[2]) - _cdiv(k, BLOCK)


def _pad2(x: jax.Array, rows: int, cols: int, value=0) -> jax.Array:
  if x.shape == (rows, cols):
    return x
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])), constant_values=value)


def gemm(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  *,
  b_blocks: bool,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """out [P, Q] = blockwise-scaled a [P, C] . b [Q, C]^T on cuBLASLt (see the module doc).

  Shapes that cuBLASLt's alignment rules reject are padded with zeros (data) and ones
  (scales), which add nothing to the sums, and the result is sliced back.
  """
  (p, c), q = a.shape, b.shape[0]
  cb = _cdiv(c, BLOCK)
  want_b = (_cdiv(q, BLOCK), cb) if b_blocks else (q, cb)
  if b.shape[1] != c or a_scale.shape != (p, cb) or b_scale.shape != want_b:
    raise ValueError(
      f"cublaslt.gemm: a {a.shape}, b {b.shape}, a_scale {a_scale.shape}, "
      f"b_scale {b_scale.shape} do not fit (expected a_scale {(p, cb)}, b_scale "
      f"{want_b})"
    )
  return gemm_t(
    a, a_scale.T, b, b_scale if b_blocks else b_scale.T, b_blocks=b_blocks, out_dtype=out_dtype
  )


def gemm_t(
  a: jax.Array,
  a_scale_t: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  *,
  b_blocks: bool,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """`gemm` with the 1x128 scales already transposed, as the library reads them:
  a_scale_t [ceil(C/128), P]; b_scale [ceil(Q/128), ceil(C/128)] (blocks) or, for 1x128
  groups, [ceil(C/128), Q]. (`jetrl.kernels.quant_kernel` writes scales this way.)"""
  (p, c), q = a.shape, b.shape[0]
  cb = _cdiv(c, BLOCK)
  want_b = (_cdiv(q, BLOCK), cb) if b_blocks else (cb, q)
  if b_blocks and b_scale.shape == (want_b[0], _block_ld(_padded(p, q, c)[2])):
    want_b = b_scale.shape  # already padded to the leading dimension (`scale_padding`)
  if b.shape[1] != c or a_scale_t.shape != (cb, p) or b_scale.shape != want_b:
    raise ValueError(
      f"cublaslt.gemm_t: a {a.shape}, b {b.shape}, a_scale_t "
      f"{a_scale_t.shape}, b_scale {b_scale.shape} do not fit (expected "
      f"a_scale_t {(cb, p)}, b_scale {want_b})"
    )
  if p == 0 or q == 0:
    return jnp.zeros((p, q), out_dtype)
  padded_scales = b_blocks and b_scale.shape[1] != cb
  call = _partitioned(bool(b_blocks), jnp.dtype(out_dtype).name, padded_scales)
  return call(a, a_scale_t, b, b_scale)


@functools.lru_cache(maxsize=None)
def _partitioned(b_blocks: bool, out_dtype: str, padded_scales: bool):
  """`_gemm_local` sharded as its operands are on a mesh (jetrl.kernels.partition): rows of
  a and b pass through, a contraction split into whole 128-blocks is summed across devices.
  Scales padded to cuBLASLt's leading dimension (a rollout's weight) keep K unsplit."""
  fn = functools.partial(_gemm_local, b_blocks=b_blocks, out_dtype=jnp.dtype(out_dtype))
  if b_blocks:
    rule = "p c, cb p, q c, qb " + ("cl" if padded_scales else "cb") + " -> p q"
    ties = {"cb": "c", "qb": "q"}
  else:
    rule, ties = "p c, cb p, q c, cb q -> p q", {"cb": "c"}
  whole = (1 << 62) if padded_scales else BLOCK  # padded scales: K never split
  block = {"c": whole, "cl": whole, "q": BLOCK if b_blocks else 1}
  return partition.sharded(fn, rule, ties=ties, block=block)


def _gemm_local(a, a_scale_t, b, b_scale, *, b_blocks: bool, out_dtype):
  """`gemm_t` on one device's operands (their shapes checked by the caller)."""
  (p, c), q = a.shape, b.shape[0]
  pp, qp, cp = _padded(p, q, c)
  cbp = cp // BLOCK
  a = _pad2(a, pp, cp)
  b = _pad2(b, qp, cp)
  sa = _pad2(a_scale_t.astype(jnp.float32), cbp, pp, 1.0)
  if b_blocks:
    ld = _block_ld(cp)
    sb = _pad2(b_scale.astype(jnp.float32), _cdiv(qp, BLOCK), ld, 1.0)
  else:
    ld = 0
    sb = _pad2(b_scale.astype(jnp.float32), cbp, qp, 1.0)
  call = jax.ffi.ffi_call(
    TARGET,
    (
      jax.ShapeDtypeStruct((pp, qp), out_dtype),
      jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    ),
    vmap_method="sequential",
  )
  out, _ = call(a, b, sa, sb, b_blocks=np.int64(int(b_blocks)), b_scale_ld=np.int64(ld))
  return out[:p, :q] if (pp, qp) != (p, q) else out


def reference(a, a_scale, b, b_scale, *, b_blocks: bool) -> np.ndarray:
  """float64 numpy value of `gemm` (the blockwise formula, block by block)."""
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  sa, sb = np.asarray(a_scale, np.float64), np.asarray(b_scale, np.float64)
  (p, c), q = a64.shape, b64.shape[0]
  if b_blocks:
    sb = np.repeat(sb, BLOCK, axis=0)[:q]
  out = np.zeros((p, q))
  for kb in range(_cdiv(c, BLOCK)):
    sl = slice(BLOCK * kb, BLOCK * (kb + 1))
    out += np.outer(sa[:, kb], sb[:, kb]) * (a64[:, sl] @ b64[:, sl].T)
  return out


def self_check() -> Optional[str]:
  """Run small GEMMs of both scale kinds (ragged sizes, a K-block count that is not a multiple
  of 4) against the float64 formula; a message if any disagrees, else None."""
  rng = np.random.default_rng(0)
  for p, q, c, blocks in ((24, 136, 640, True), (40, 264, 520, False)):
    a = rng.standard_normal((p, c)).astype(np.float32).astype(E4M3)
    b = rng.standard_normal((q, c)).astype(np.float32).astype(E4M3)
    sa = rng.uniform(0.5, 2.0, (p, _cdiv(c, BLOCK))).astype(np.float32)
    sb = rng.uniform(0.5, 2.0, ((_cdiv(q, BLOCK) if blocks else q), _cdiv(c, BLOCK))).astype(
      np.float32
    )
    if not supported(p, q, c, E4M3, E4M3, jnp.float32, blocks):
      return f"no cuBLASLt algorithm for a {p}x{q}x{c} problem (b_blocks={blocks})"
    out = np.asarray(
      jax.jit(functools.partial(gemm, b_blocks=blocks, out_dtype=jnp.float32))(a, sa, b, sb),
      np.float64,
    )
    ref = reference(a, sa, b, sb, b_blocks=blocks)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    if not err < SELF_CHECK_TOL:
      return (
        f"{p}x{q}x{c} (b_blocks={blocks}): relative error {err:.3g} against the "
        "float64 blockwise formula"
      )
  return None
