"""What the parts of experiments/bench_device.py share: the time budget, timing loops, device
memory, the model and recipe of a measurement (with the one-pass quantization kernel as a
field of its own), the profiler, and the rows a measurement adds to the results.

Imported by bench_device.py after it has set XLA_FLAGS (importing JAX does not start the
backend; importing this module after that keeps the order explicit).
"""

from __future__ import annotations

import contextlib
import os
import dataclasses
import math
import shutil
import tempfile
import time
from typing import Callable, Iterator, Optional, Sequence

from absl import flags

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jetrl.precision as precision

FLAGS = flags.FLAGS
_T0 = time.perf_counter()

# Whether cuBLASLt's FP8 GEMM loaded (bench_device.main sets it on a GPU).
CUBLASLT_OK = False


def start_clock(t0: float) -> None:
  """Count the time budget from t0 (the program's start, before XLA_FLAGS were chosen)."""
  global _T0  # pylint: disable=global-statement
  _T0 = t0


def elapsed() -> float:
  return time.perf_counter() - _T0


def over_budget(fraction: float = 1.0) -> bool:
  return elapsed() > FLAGS.time_budget_s * fraction


def error_text(e: BaseException, limit: int = 300) -> str:
  return f"{type(e).__name__}: {str(e)[:limit]}"


def kernel_backend(interpret: bool) -> str:
  return "pallas_interpret" if interpret else ("cublaslt" if CUBLASLT_OK else "pallas")


# --- timing ----------------------------------------------------------------------------------


def call_loop(fn, iters: int):
  """run(*args): `iters` calls of fn(*args) in one fori_loop, the last call's output returned.

  Each iteration passes its inputs through an optimization barrier, so XLA can neither hoist
  the work out of the loop nor drop it (experiments/calibrate_cost_model.py compiles the same
  loop)."""

  def run(*a):
    out_shape = jax.eval_shape(fn, *a)

    def body(_, carry):
      a_, _y = lax.optimization_barrier(carry)
      return a_, fn(*a_)

    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    return lax.fori_loop(0, iters, body, (tuple(a), zeros))[1]

  return run


def loop_time(fn, args, est_s: float, repeats: int) -> float:
  """Seconds per call of fn(*args), from a jitted loop of calls (`call_loop`: no per-call
  dispatch cost)."""
  iters = int(min(200, max(3, math.ceil(0.03 / max(est_s, 1e-7)))))
  run = jax.jit(call_loop(fn, iters))
  jax.block_until_ready(run(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args))
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times))


def call_time(fn, repeats: int) -> float:
  """Median seconds of fn() (already compiled by one warm-up call)."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def memory_gib() -> dict:
  """Peak and current device memory (GiB) from the device's own counters, where it has them."""
  try:
    st = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    st = {}
  gib = lambda v: round(v / 2**30, 2)
  return {
    k: gib(st[key])
    for k, key in (
      ("peak_gib", "peak_bytes_in_use"),
      ("in_use_gib", "bytes_in_use"),
      ("limit_gib", "bytes_limit"),
    )
    if key in st
  }


# --- what is measured ------------------------------------------------------------------------


def load_model(name: str, dtype):
  """(config, params) of a preset, with random weights of `dtype`."""
  from jetrl.models import get_config, init_params  # pylint: disable=import-outside-toplevel

  cfg = get_config(name)
  return cfg, init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)


def param_count(params) -> int:
  return int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(params)))


def random_prompts(vocab_size: int, n: int, length: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [list(rng.integers(1, vocab_size, length)) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class Variant:
  """A recipe as measured: `fused_quant` runs it on cuBLASLt with the one-pass quantization
  kernel (jetrl.kernels.quant_kernel), labelled "<recipe>+fq"; `decode_gemm` also runs a
  decode step's FP8 GEMMs on the Pallas decode kernel (JETRL_DECODE_GEMM=pallas,
  gemm_pallas.decode_matmul_nt), labelled "<recipe>+fq+pd"; `kv_fp8` gives the rollout an FP8
  KV cache (`--kv_cache=fp8`), labelled "<recipe>+kv8"."""

  recipe: str
  fused_quant: bool = False
  decode_gemm: bool = False
  fused_mlp: bool = True  # False: the update's MLP unfused (JETRL_FUSED_MLP=0), "+fq-mlp"
  kv_fp8: bool = False

  @property
  def label(self) -> str:
    return (
      self.recipe
      + ("+fq" if self.fused_quant else "")
      + ("+pd" if self.decode_gemm else "")
      + ("" if self.fused_mlp else "-mlp")
      + ("+kv8" if self.kv_fp8 else "")
    )

  def row(self) -> dict:
    return dict(
      recipe=self.label,
      fused_quant=self.fused_quant,
      decode_gemm=self.decode_gemm,
      fused_mlp=self.fused_mlp,
      kv_cache="fp8" if self.kv_fp8 else "compute",
    )


def variants(
  recipes: Sequence[str],
  fused_quant: Sequence[str] = (),
  decode_gemm: Sequence[str] = (),
  unfused_mlp: Sequence[str] = (),
  kv_fp8: Sequence[str] = (),
) -> tuple[Variant, ...]:
  """Each recipe, then each of `fused_quant` (recipes too) with the one-pass kernel, then each
  of `decode_gemm` with the one-pass kernel and the Pallas decode GEMM, then each of
  `unfused_mlp` with the one-pass kernel and the MLP unfused (jetrl.kernels.mlp off), then
  each of `kv_fp8` with the one-pass kernel and an FP8 KV cache."""
  return (
    tuple(Variant(r) for r in recipes)
    + tuple(Variant(r, True) for r in fused_quant)
    + tuple(Variant(r, True, True) for r in decode_gemm)
    + tuple(Variant(r, True, False, False) for r in unfused_mlp)
    + tuple(Variant(r, True, kv_fp8=True) for r in kv_fp8)
  )


def recipe_of(variant: Variant, interpret: bool):
  """The variant's recipe as a run gets it; in the CPU smoke test on the XLA path (the
  interpreted kernel is checked by the GEMM part: a whole model in interpret mode takes
  minutes). With fused_quant, on cuBLASLt: its explicit backend makes it a different static
  argument, so its programs are traced anew, with the kernel on for that first, tracing call
  (`fused_quant`)."""
  rec = precision.get_recipe(variant.recipe, kv_cache="fp8" if variant.kv_fp8 else "compute")
  if interpret:
    return precision.with_gemm_backend(rec, "xla")
  if variant.fused_quant:
    return precision.with_gemm_backend(rec, "cublaslt")
  return rec


@contextlib.contextmanager
def _kernel_setting(name: str, value: Optional[str]) -> Iterator[None]:
  """The kernel setting `name` (a JETRL_* variable, read where a plan is resolved without a
  `KernelConfig`: jetrl.kernels.device) set to `value` inside (None: unset), restored after."""
  before = os.environ.get(name)
  if value is None:
    os.environ.pop(name, None)
  else:
    os.environ[name] = value
  try:
    yield
  finally:
    if before is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = before


@contextlib.contextmanager
def decode_gemm(on: bool) -> Iterator[None]:
  """With `on`, the Pallas decode GEMM while programs are traced inside, JAX's caches cleared
  on entry and exit (the recipe object is the same as without it, so a cached trace would be
  reused); else nothing."""
  if not on:
    yield
    return
  import jax  # pylint: disable=import-outside-toplevel

  jax.clear_caches()
  try:
    with _kernel_setting("JETRL_DECODE_GEMM", "pallas"):
      yield
  finally:
    jax.clear_caches()


@contextlib.contextmanager
def unfused_mlp(on: bool) -> Iterator[None]:
  """With `on`, the MLP's unfused path (JETRL_FUSED_MLP=0) while programs are traced inside,
  JAX's caches cleared on entry and exit (as `decode_gemm`); else nothing."""
  if not on:
    yield
    return
  import jax  # pylint: disable=import-outside-toplevel

  jax.clear_caches()
  try:
    with _kernel_setting("JETRL_FUSED_MLP", "0"):
      yield
  finally:
    jax.clear_caches()


@contextlib.contextmanager
def fused_quant(on: bool = True) -> Iterator[None]:
  """The one-pass quantization kernel turned on (or off) while programs are traced inside;
  the default (on for a GPU) after."""
  with _kernel_setting("JETRL_FUSED_QUANT", "1" if on else "0"):
    yield


def with_fused_quant(fn):
  """fn traced with the one-pass quantization kernel."""

  def wrapped(*args):
    with fused_quant():
      return fn(*args)

  return wrapped


def profile(fn, steps: int, name: str) -> dict:
  """`fn` once under the profiler (jetrl.kernel_profile), the trace deleted; printed too."""
  from jetrl.kernel_profile import format_summary, profile_call  # pylint: disable=import-outside-toplevel

  d = tempfile.mkdtemp(prefix="jetrl_profile_")
  try:
    s = profile_call(fn, d, steps=steps)
    s.pop("trace", None)
  except Exception as e:  # pylint: disable=broad-except
    s = dict(kernels=0, note=f"profiling failed: {error_text(e)}")
  finally:
    shutil.rmtree(d, ignore_errors=True)
  for ln in format_summary(s):
    print(f"  {name}: {ln}", flush=True)
  return s


# --- results ---------------------------------------------------------------------------------


def measure(rows: list, row: dict, fn: Callable[[], dict], budget: float, done: str) -> None:
  """Append `row` with what fn() measured (and the device memory) to rows: skipped past the
  time budget share `budget`, or with the error fn raised."""
  if over_budget(budget):
    rows.append(dict(row, skipped="time budget"))
    return
  try:
    rows.append(dict(row, **fn(), **memory_gib()))
  except Exception as e:  # pylint: disable=broad-except
    rows.append(dict(row, skipped=error_text(e)))
  print(f"  ... {done} done at {elapsed():.0f} s", flush=True)


def add_speedups(rows, key: str, larger_is_better: bool, group=()):
  for r in rows:
    base = next(
      (
        b
        for b in rows
        if b.get("recipe") == "bf16" and key in b and all(b.get(g) == r.get(g) for g in group)
      ),
      None,
    )
    if base and key in r:
      r["speedup_vs_bf16"] = (r[key] / base[key]) if larger_is_better else (base[key] / r[key])


def speedup_text(r: dict) -> str:
  return f"  {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
