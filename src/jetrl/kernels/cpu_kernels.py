"""`jet_exact`'s exact sums as CPU kernels (XLA FFI custom calls): the same bits, faster.

`jet_exact` makes every forward sum exact (docs/numerics.md, "Bitwise on-policy"), and XLA:CPU
runs those sums as float64 dots: one per 128-wide K block of every FP8 GEMM, each with its own
conversions and partial outputs, and batched float64 dots (or multiply-and-sum loops) for the
attention and the LM head. `csrc/exact_cpu.cc` computes them in one call each:
  - `exact_fp8_gemm`: `exact.fp8_fprop`'s formula from the E4M3 bytes, the block dots in
    float64 FMAs (exact, so their order and fusion cannot matter), the scaling and the float32
    sum over blocks in the same IEEE operations and order as the XLA path;
  - `exact_dot`: a batched float64 dot of operands on fixed-point grids (QK^T, PV, the LM
    head: `jetrl.kernels.exact_ops`), whose every partial sum is exact.
An exact sum has one value, so the results are the XLA path's bit for bit; the tests check
both against numpy references. The kernels are built on first use with -march=native
(`ffi_build`), registered for XLA's CPU platform and checked bit for bit against the XLA path
and an integer reference before anything uses them; when any of that fails,
`unavailable_reason()` says why (with a warning) and the XLA path runs. They are used only in a
process with one device (`usable(dev)`, for a plan's device): XLA cannot partition a custom call, and would gather
its operands onto every device of a mesh.

`--kernels.exact_cpu_kernel=false` (`KernelConfig.exact_cpu_kernel`, jetrl.kernels.device;
default from JETRL_EXACT_CPU_KERNEL) keeps the XLA path (the same bits, more slowly); JETRL_EXACT_CPU_THREADS=N sets
the kernels' threads (default: XLA's intra-op threads; read by the library, no result depends
on it).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jetrl.kernels import ffi_build
from jetrl.kernels.device import Device

SOURCE = Path(__file__).parent / "csrc" / "exact_cpu.cc"
TARGET = "jetrl_exact_fp8_gemm"
DOT_TARGET = "jetrl_exact_dot"
# -ffp-contract=off: the scaling and the float32 sum over blocks must not be fused (the
# kernel's block dots use explicit FMAs, exact either way).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off")


_LOCK = threading.Lock()
_CHECK_THREAD = "jetrl-kernel-check"
_CHECKS: list[Callable[[], Optional[str]]] = []


def unavailable_reason() -> Optional[str]:
  """Why the kernels cannot run in this process (None if they can); decided once, on first
  use (which builds them: about 3 s the first time on a machine, cached after)."""
  with _LOCK:
    return _load()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
  try:
    path = ffi_build.build(SOURCE, flags=FLAGS)
    lib = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JetrlExactFp8Gemm), platform="cpu")
    jax.ffi.register_ffi_target(DOT_TARGET, jax.ffi.pycapsule(lib.JetrlExactDot), platform="cpu")
    problem = _outside_any_trace(_self_check)
  except Exception as e:  # pylint: disable=broad-except
    problem = f"{type(e).__name__}: {e}"
  if problem:
    warnings.warn(
      f"jet_exact's CPU kernels are not used ({problem}); the XLA path computes "
      "the same bits, more slowly",
      stacklevel=3,
    )
  return problem


def _outside_any_trace(fn):
  """fn() on a fresh thread: the first use is usually inside a jit trace (thread-local), and
  the check needs concrete arrays."""
  out = {}

  def run():
    try:
      out["value"] = fn()
    except Exception as e:  # pylint: disable=broad-except
      out["value"] = f"{type(e).__name__}: {e}"

  t = threading.Thread(target=run, name=_CHECK_THREAD)
  t.start()
  t.join()
  return out["value"]


def add_self_check(check: Callable[[], Optional[str]]) -> None:
  """Add a check the kernels must pass before anything uses them: `check()` returns what is
  wrong, or None. `jetrl.precision.exact` adds the GEMM's (it owns the XLA path the kernel
  must match bit for bit), so that this module needs nothing of it."""
  _CHECKS.append(check)


def _self_check() -> Optional[str]:
  for check in _CHECKS:
    problem = check()
    if problem:
      return problem
  rng = np.random.default_rng(0)
  cpu = jax.devices("cpu")[0]
  # The exact dot, both layouts, on integers whose sums are exact in float64.
  a = rng.integers(-(2**20), 2**20, (3, 5, 70)).astype(np.float64)
  b = rng.integers(-(2**7), 2**7, (3, 70, 37)).astype(np.float32)
  want = np.einsum("tmk,tkn->tmn", a, b.astype(np.float64))
  with jax.default_device(cpu), jax.enable_x64(True):
    for b_nk, bb in ((False, b), (True, np.swapaxes(b, 1, 2))):
      got = np.asarray(
        jax.jit(lambda a, b: exact_dot(a, b, b_nk=b_nk))(a, jnp.asarray(bb, jnp.bfloat16))
      )
      if not np.array_equal(got, want):
        return f"self-check: the exact dot (b_nk={b_nk}) differs from the integer reference"
  return None


def available() -> bool:
  """Whether the kernels are built, registered and self-checked in this process."""
  return unavailable_reason() is None


def _require(target: str) -> None:
  """Build and register the kernels if not done yet (a direct call may come before any
  `usable()`), or a clear error if they cannot run. The self-check's own calls, on its thread
  while loading holds the lock, skip this."""
  if threading.current_thread().name == _CHECK_THREAD:
    return
  reason = unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"{target}: jet_exact's CPU kernels are not available here ({reason})")


def exact_fp8_gemm(
  xq: jax.Array, sx: jax.Array, q: jax.Array, sw: jax.Array, block: int
) -> jax.Array:
  """float32 [M, N] of `exact.fp8_fprop` from quantized operands: xq [M, K] and q [K, N]
  E4M3, sx [M, ceil(K/block)] and sw [ceil(K/block), ceil(N/block)] float32 scales.

  Callers check `usable()` first (one device in the process).
  """
  _require(TARGET)
  m, n = xq.shape[0], q.shape[1]
  u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  call = jax.ffi.ffi_call(
    TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential"
  )
  return call(u8(xq), sx.astype(jnp.float32), u8(q), sw.astype(jnp.float32), block=np.int64(block))


def exact_dot(a: jax.Array, b: jax.Array, *, b_nk: bool) -> jax.Array:
  """float64 c [T, M, N] = a [T, M, K] times b [T, K, N] (or b [T, N, K] when b_nk), for
  operands whose every partial sum is exact in float64 (`jetrl.kernels.exact_ops`' grids):
  one value whatever the order. a float32 / float64, b bfloat16 / float32. Call it inside
  `jax.enable_x64`; one-device processes only (see `exact_fp8_gemm`)."""
  if a.ndim != 3 or b.ndim != 3:
    raise ValueError(
      f"exact_dot: a [T, M, K] and b [T, K, N] (or [T, N, K]) must be 3-D; "
      f"got a {a.shape} and b {b.shape}"
    )
  if a.dtype not in (jnp.float32, jnp.float64) or b.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(
      f"exact_dot: a must be float32 or float64 and b bfloat16 or float32; got "
      f"{a.dtype} and {b.dtype}"
    )
  _require(DOT_TARGET)
  t, m, k = a.shape
  n = b.shape[1] if b_nk else b.shape[2]
  if b.shape[0] != t or (b.shape[2] if b_nk else b.shape[1]) != k:
    raise ValueError(f"exact_dot: a {a.shape} and b {b.shape} (b_nk={b_nk}) do not share T and K")
  call = jax.ffi.ffi_call(
    DOT_TARGET, jax.ShapeDtypeStruct((t, m, n), jnp.float64), vmap_method="sequential"
  )
  return call(a, b, b_nk=bool(b_nk))


def usable(dev: Device) -> bool:
  """Whether code traced for `dev` (a plan's device) should call the kernels: the
  CPU backend, its `KernelConfig.exact_cpu_kernel` on, one device in the process (XLA would
  gather a custom call's operands onto every device), kernel built."""
  return (
    dev.platform == "cpu"
    and dev.kernels.exact_cpu_kernel
    and jax.device_count() == 1
    and available()
  )
