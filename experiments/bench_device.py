"""Device benchmark: FP8 GEMMs, rollout and training against bf16, on one GPU (H100 / H200).

  python experiments/bench_device.py --json_out=bench_device.json
  python experiments/bench_device.py --allow_cpu --json_out=/tmp/smoke.json   # CPU smoke test

It measures, on one H100 / H200 (experiments/gpu_check.py runs it with the test suite and the
peers in one call):
  (a) GEMM throughput on the linear layers of Qwen2.5-1.5B and Llama-3.1-8B, for prefill /
      training token counts (M = 4096, 16384) and decode batches (M = 8, 64, 256), variants
      listed in `gemm_variants` (bf16, cuBLASLt blockwise FP8, `linear` under jet with its
      quantization, forward + backward under bf16 and jet, XLA's per-tensor FP8 dot), in
      TFLOP/s, microseconds and speed-up over bf16; plus the kernel's agreement with the XLA
      path and the FP8-in-the-compiled-program check;
  (b) the sampler's tokens per second under bf16, fp8_rollout and jet on a ~1.5B model, with
      ms per decode step, compile time and peak memory;
  (c) one update step under bf16 and jet (ms, tokens/s, MFU = 6 x params x tokens / time /
      peak, peak memory, whether layers were rematerialised);
  (d) one RL step (rollout, reward, advantages, update) with the time split.
A part whose dependency is missing prints "skipped: <reason>" and the rest runs on.

Without a GPU it exits with code 2 unless --allow_cpu is given; then it runs tiny shapes with the
kernel in Pallas interpret mode, as a smoke test whose timings mean nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool(
  "allow_cpu", False, "Run without a GPU: tiny shapes, interpret mode (smoke test)."
)
flags.DEFINE_list(
  "sections", ["gemm", "rollout", "update", "e2e"], "Parts to run: gemm, rollout, update, e2e."
)
flags.DEFINE_list("gemm_models", ["qwen2.5-1.5b", "llama-3.1-8b"], "Presets whose GEMMs to time.")
flags.DEFINE_list("prefill_m", ["4096", "16384"], "Token counts M of prefill / training GEMMs.")
flags.DEFINE_list(
  "decode_m", ["8", "64", "256"], "Token counts M of decode GEMMs (first model only)."
)
flags.DEFINE_bool("pallas", False, "Also time the Pallas kernel (always, when cuBLASLt is out).")
flags.DEFINE_float("gemm_budget_fraction", 0.4, "Share of --time_budget_s the GEMMs may use.")
flags.DEFINE_float(
  "peak_tflops",
  989.0,
  "Dense bf16 peak of the GPU in TFLOP/s (H100 / H200 SXM: "
  "~989; H100 PCIe: ~756). FP8 peak is twice this.",
)
flags.DEFINE_string(
  "tiles",
  "",
  "Kernel tiles to try, 'bm x bn x warps x stages' joined by ','"
  " (e.g. 128x128x8x3,64x128x4x4; a trailing 'p' turns fast accumulation off: "
  "128x128x8x3p); each is reported as fp8_block@i and the fastest as "
  "fp8_block. Empty: the defaults.",
)
flags.DEFINE_string("model", "qwen2.5-1.5b", "Preset for the rollout and update parts.")
flags.DEFINE_string("param_dtype", "bfloat16", "Stored dtype of the params for the rollout.")
flags.DEFINE_string(
  "rollout_settings",
  "64x256x256,256x256x256,64x256x1024",
  "Rollout settings, batch x prompt tokens x new tokens, joined by ','.",
)
flags.DEFINE_integer("prompt_len", 256, "Prompt tokens per row (one RL step).")
flags.DEFINE_integer("new_tokens", 256, "Generated tokens per row (one RL step).")
flags.DEFINE_integer("update_rows", 16, "Rows of the update batch.")
flags.DEFINE_integer("update_prompt_len", 512, "Prompt tokens per update row.")
flags.DEFINE_integer("update_completion_len", 512, "Completion tokens per update row.")
flags.DEFINE_integer("e2e_prompts", 16, "Prompts per RL step (one RL step).")
flags.DEFINE_integer("e2e_group", 4, "Samples per prompt (one RL step).")
flags.DEFINE_integer("e2e_micro_batches", 1, "Micro-batches of the RL step's update.")
flags.DEFINE_float("rollout_budget_fraction", 0.65, "Budget share by which rollouts end.")
flags.DEFINE_list(
  "rollout_recipes",
  ["bf16", "fp8_rollout", "jet"],
  "Rollout recipes; '<recipe>+fq' adds the one-pass quantization kernel.",
)
flags.DEFINE_list(
  "update_recipes",
  ["bf16", "jet"],
  "Update recipes; '<recipe>+fq' adds the one-pass quantization kernel.",
)
flags.DEFINE_float("update_budget_fraction", 0.85, "Budget share by which updates end.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (the median is reported).")
flags.DEFINE_float("time_budget_s", 240.0, "Stop starting new measurements after this long.")
flags.DEFINE_string(
  "xla_extra_flags",
  "--xla_gpu_enable_triton_gemm=false",
  "XLA flags for the run (default: XLA dots go to cuBLAS / cuBLASLt, which also "
  "keeps compile times short); dropped if this XLA rejects them.",
)
flags.DEFINE_bool("ptx_check", True, "Dump the PTX of a probe program and count FP8 MMA lines.")
flags.DEFINE_bool(
  "profile",
  False,
  "After timing each rollout and update, run it once more under the profiler and record its "
  "kernels (jetrl.kernel_profile: count per decode step, device busy share, the top kernels); "
  "the traces themselves are deleted.",
)
flags.DEFINE_string("json_out", None, "Path for the results as JSON.")

_T0 = time.perf_counter()


def elapsed() -> float:
  return time.perf_counter() - _T0


def over_budget(fraction: float = 1.0) -> bool:
  return elapsed() > FLAGS.time_budget_s * fraction


def _probe_backend(xla_flags: str) -> tuple[int, str]:
  """Start JAX in a child process with these XLA flags: (exit code, 'platform cc' or error)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  code = (
    "import jax; d = jax.devices()[0]; "
    "print(jax.default_backend(), getattr(d, 'compute_capability', ''), d.device_kind)"
  )
  try:
    r = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
  except subprocess.TimeoutExpired:
    return 1, "timeout"
  return r.returncode, (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]


def setup_xla_flags() -> dict:
  """Choose XLA flags before JAX starts: the extra ones if this XLA takes them, and a PTX dump."""
  base = os.environ.get("XLA_FLAGS", "")
  info = {"extra_flags": "", "dump_dir": None, "notes": []}
  candidate = (base + " " + FLAGS.xla_extra_flags).strip()
  rc, out = _probe_backend(candidate)
  if rc != 0 and FLAGS.xla_extra_flags:
    info["notes"].append(f"XLA rejected {FLAGS.xla_extra_flags!r}: {out}")
    candidate = base
    rc, out = _probe_backend(candidate)
  else:
    info["extra_flags"] = FLAGS.xla_extra_flags
  info["probe"] = out
  if FLAGS.ptx_check and out.startswith("gpu"):
    info["dump_dir"] = tempfile.mkdtemp(prefix="jetrl_xla_dump_")
    candidate += f" --xla_dump_to={info['dump_dir']} --xla_dump_hlo_module_re=.*fp8_ptx_probe.*"
  os.environ["XLA_FLAGS"] = candidate.strip()
  return info


# Imported after the flags are set up (importing does not start the backend; be explicit anyway).
def _imports():
  global jax, jnp, np, lax, precision, gp, backend, cublaslt, gemms, qk  # pylint: disable=global-variable-undefined
  import jax  # pylint: disable=redefined-outer-name
  import jax.numpy as jnp  # pylint: disable=redefined-outer-name
  import numpy as np  # pylint: disable=redefined-outer-name
  from jax import lax  # pylint: disable=redefined-outer-name
  import jetrl.precision as precision  # pylint: disable=redefined-outer-name
  from jetrl.precision import backend  # pylint: disable=redefined-outer-name
  from jetrl.precision import gemm_pallas as gp  # pylint: disable=redefined-outer-name
  from jetrl.precision import cublaslt  # pylint: disable=redefined-outer-name
  from jetrl.precision import gemms  # pylint: disable=redefined-outer-name
  from jetrl.precision import quant_kernel as qk  # pylint: disable=redefined-outer-name


CUBLASLT_OK = False


# --- timing ----------------------------------------------------------------------------------


def loop_time(fn, args, est_s: float, repeats: int) -> float:
  """Seconds per call of fn(*args), from a jitted loop of calls (no per-call dispatch cost).

  Each iteration passes its inputs through an optimization barrier, so XLA can neither hoist
  the work out of the loop nor drop it.
  """
  iters = int(min(200, max(3, math.ceil(0.03 / max(est_s, 1e-7)))))
  out_shape = jax.eval_shape(fn, *args)

  def run(*a):
    def body(_, carry):
      a_, y = lax.optimization_barrier(carry)
      return a_, fn(*a_)

    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    return lax.fori_loop(0, iters, body, (tuple(a), zeros))[1]

  run = jax.jit(run)
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


# --- (a) GEMMs ------------------------------------------------------------------------------


def gemm_shapes(model: str) -> list[tuple[str, int, int]]:
  """(name, K, N) of a preset's distinct linear layers."""
  from jetrl.models import get_config  # pylint: disable=import-outside-toplevel

  c = get_config(model)
  q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  out, seen = [], set()
  for name, k, n in (
    ("q", c.d_model, q),
    ("k/v", c.d_model, kv),
    ("o", q, c.d_model),
    ("gate/up", c.d_model, c.d_ff),
    ("down", c.d_ff, c.d_model),
  ):
    if (k, n) not in seen:
      seen.add((k, n))
      out.append((name, k, n))
  return out


def parse_tiles(text: str):
  if not text:
    return [None]
  tiles = []
  for item in text.lower().split(","):
    precise = item.endswith("p")
    bm, bn, warps, stages = (int(v) for v in item.rstrip("p").split("x"))
    tiles.append(gp.Tiles(bm=bm, bn=bn, num_warps=warps, num_stages=stages, fast_accum=not precise))
  return tiles


def gemm_variants(m, k, n, interpret: bool, tiles_list, decode: bool):
  """{variant: (fn, args)} for an [m, k] x [k, n] GEMM.

  bf16          XLA's bf16 dot (cuBLAS), bf16 out: the baseline
  fp8_cublaslt  cuBLASLt's blockwise FP8 GEMM on operands already quantized (the kernel alone)
  fp8_pallas    the Pallas kernel on the same operands (only with --pallas)
  fp8_tensor    XLA's per-tensor FP8 dot (cuBLASLt), scales applied outside
  linear        `linear` under jet: quantize x (and, for prefill sizes, the weight blocks, as
                the training forward does once per step), then the kernel. For decode sizes the
                weight comes pre-quantized, as the sampler passes it.
  train_bf16 / train_jet  forward + dgrad + wgrad of `linear` (value and both gradients)
  """
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (m, k), jnp.bfloat16)
  w = (0.02 * jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(2), (m, n), jnp.bfloat16)
  xq, xs = precision.quantize(x, (1, 128))
  wq, ws = precision.quantize(w.T, (128, 128))  # [N, K] blocks
  tq, ts = precision.quantize(x, x.shape)
  uq, us = precision.quantize(w.T, (n, k))
  kernel = "pallas_interpret" if interpret else ("cublaslt" if CUBLASLT_OK else "pallas")
  jet = precision.with_gemm_backend(precision.get_recipe("jet"), kernel)
  bf16 = precision.get_recipe("bf16")
  out = {
    "bf16": (
      lambda a, b: lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16
      ),
      (x, w),
    ),
    "fp8_tensor": (
      lambda a, b, s: (
        lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * s
      ).astype(jnp.bfloat16),
      (tq, uq, ts[0, 0] * us[0, 0]),
    ),
  }
  if CUBLASLT_OK:
    out["fp8_cublaslt"] = (
      lambda a, sa, b, sb: cublaslt.gemm(a, sa, b, sb, b_blocks=True, out_dtype=jnp.bfloat16),
      (xq, xs, wq, ws),
    )
  if FLAGS.pallas or not CUBLASLT_OK:
    for i, t in enumerate(tiles_list):
      name = "fp8_pallas" if len(tiles_list) == 1 else f"fp8_pallas@{i}"
      ws_rows = jnp.repeat(ws, 128, axis=0)[:n]
      out[name] = (
        lambda a, sa, b, sb, t=t: gp.scaled_matmul_nt(
          a, sa, b, sb, out_dtype=jnp.bfloat16, interpret=interpret, tiles=t
        ),
        (xq, xs, wq, ws_rows),
      )
  fq = _with_fused_quant
  if decode:
    qw = precision.prequantize_weight(
      w, jet.rollout.fprop, k_major=backend.wants_k_major(jet.rollout.fprop)
    )
    out["linear"] = (lambda a, q: precision.linear(a, q, jet.rollout), (x, qw))
    if CUBLASLT_OK:
      out["linear_fq"] = (fq(lambda a, q: precision.linear(a, q, jet.rollout)), (x, qw))
  else:
    out["linear"] = (lambda a, b: precision.linear(a, b, jet.rollout), (x, w))
    if CUBLASLT_OK:
      out["linear_fq"] = (fq(lambda a, b: precision.linear(a, b, jet.rollout)), (x, w))
      out["quantize_x"] = (lambda a: precision.quantize(a, (1, 128)), (x,))
      out["quantize_x_fq"] = (
        lambda a: qk.quantize_rows_cols(a, jnp.float8_e4m3fn, cols=False),
        (x,),
      )
      out["quantize_x_rows_cols_fq"] = (lambda a: qk.quantize_rows_cols(a, jnp.float8_e4m3fn), (x,))
    for name, rec in (("train_bf16", bf16), ("train_jet", jet)):
      out[name] = (
        lambda a, b, d, rec=rec: jax.vjp(lambda a_, b_: precision.linear(a_, b_, rec.train), a, b)[
          1
        ](d),
        (x, w, dy),
      )
    if CUBLASLT_OK:
      out["train_jet_fq"] = (
        fq(lambda a, b, d: jax.vjp(lambda a_, b_: precision.linear(a_, b_, jet.train), a, b)[1](d)),
        (x, w, dy),
      )
  return out


GEMM_FLOP_MULT = {"train_bf16": 3.0, "train_jet": 3.0, "train_jet_fq": 3.0}


def _with_fused_quant(fn):
  """fn traced with the one-pass quantization kernel (jetrl.precision.quant_kernel)."""

  def wrapped(*args):
    gemms.set_fused_quant(True)
    try:
      return fn(*args)
    finally:
      gemms.set_fused_quant(False)

  return wrapped


def run_gemms(ms, models, interpret: bool, repeats: int, decode_ms=()):
  rows, tiles_list = [], parse_tiles(FLAGS.tiles)
  peak = FLAGS.peak_tflops * 1e12
  # M outermost: when time runs short, the last token counts are dropped, not a whole model.
  for m in ms:
    decode = m in decode_ms
    for model in models[:1] if decode and not interpret else models:
      for name, k, n in gemm_shapes(model):
        if over_budget(FLAGS.gemm_budget_fraction):
          rows.append(dict(model=model, layer=name, m=m, k=k, n=n, skipped="time budget"))
          continue
        flops = 2.0 * m * k * n
        est = max(flops / (0.6 * peak), (m * k + k * n + m * n) * 2 / 3e12)
        row = dict(model=model, layer=name, m=m, k=k, n=n)
        for var, (fn, args) in gemm_variants(m, k, n, interpret, tiles_list, decode).items():
          f = flops * GEMM_FLOP_MULT.get(var, 1.0)
          try:
            t = loop_time(fn, args, est * GEMM_FLOP_MULT.get(var, 1.0), repeats)
            row[var] = dict(us=1e6 * t, tflops=f / t / 1e12, frac_peak=f / t / peak)
          except Exception as e:  # pylint: disable=broad-except
            row[var] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        base = row.get("bf16", {}).get("us")
        for var in row:
          if isinstance(row[var], dict) and "us" in row[var] and var != "bf16":
            ref = row.get("train_bf16", {}).get("us") if var.startswith("train_jet") else base
            if ref and var != "train_bf16":
              row[var]["speedup_vs_bf16"] = ref / row[var]["us"]
        kern = row.get("fp8_cublaslt", row.get("fp8_pallas", {})).get("us")
        for var in ("linear", "linear_fq"):
          if kern and "us" in row.get(var, {}):
            row[var]["frac_of_kernel"] = kern / row[var]["us"]
        rows.append(row)
        print(gemm_line(row), flush=True)
  return rows


_VARS = (
  "bf16",
  "fp8_cublaslt",
  "fp8_pallas",
  "linear",
  "linear_fq",
  "train_jet",
  "train_jet_fq",
  "quantize_x",
  "quantize_x_fq",
)


def gemm_line(r) -> str:
  shape = f"{r['m']}x{r['k']}x{r['n']}"
  head = f"  {r['model']:<14} {r['layer']:<8} {shape:<18}"
  if "skipped" in r:
    return head + f" skipped: {r['skipped']}"

  def cell(var):
    v = r.get(var, {})
    if "us" not in v:
      return f"{'error' if 'error' in v else '-':<20}"
    sp = v.get("speedup_vs_bf16")
    return f"{v['tflops']:7.1f} {v['us']:8.1f}us" + (f" {sp:4.2f}x" if sp else " " * 6)

  return head + "".join(f" | {cell(v)}" for v in _VARS)


def gemm_header() -> str:
  return f"  {'model':<14} {'layer':<8} {'M x K x N':<18}" + "".join(
    f" | {v + ' TF/s us x':<26}" for v in _VARS
  )


def _kernel_backend(interpret: bool) -> str:
  return "pallas_interpret" if interpret else ("cublaslt" if CUBLASLT_OK else "pallas")


def kernel_agreement(interpret: bool, m: int, k: int, n: int) -> dict:
  """Max relative difference of fprop / dgrad / wgrad between the kernel and the XLA path.

  The jet GEMMs with float32 between operators, so only the order of float32 sums separates
  the two (docs/numerics.md states the tolerances the tests assert).
  """
  g = precision.Fp8Gemm()
  p32 = precision.Precision("float32", fprop=g, dgrad=g, wgrad=g)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  outs = {}
  kern = _kernel_backend(interpret)
  for be in ("xla", kern):
    p = precision.with_gemm_backend(p32, be)
    f = jax.jit(
      lambda a, b, d, p=p: (lambda y, vjp: (y,) + vjp(d))(
        *jax.vjp(lambda a_, b_: precision.linear(a_, b_, p), a, b)
      )
    )
    outs[be] = [np.asarray(v, np.float64) for v in f(x, w, dy)]
  ref, got = outs["xla"], outs[kern]
  rel = lambda a, b: float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
  res = {
    f"{name}_max_rel_diff": rel(g_, r) for name, g_, r in zip(("fprop", "dgrad", "wgrad"), got, ref)
  }
  res["backend"] = kern
  res["shape"] = [m, k, n]
  return res


def fp8_checks(interpret: bool, dump_dir) -> dict:
  """The FP8 check (compiled HLO on a GPU; lowering for 'cuda' otherwise), and PTX."""
  x = jnp.ones((256, 1536), jnp.bfloat16)
  w = jnp.ones((1536, 1024), jnp.float32)
  plat = None if not interpret else "cuda"
  jet = precision.with_gemm_backend(
    precision.get_recipe("jet").train, "pallas" if interpret else _kernel_backend(False)
  )
  res = {}

  def fp8_ptx_probe(a, b):
    return precision.linear(a, b, jet)

  def train(a, b):
    return jax.grad(
      lambda a_, b_: precision.linear(a_, b_, jet).astype(jnp.float32).sum(), argnums=(0, 1)
    )(a, b)

  xq, wq = x.astype(jnp.float8_e4m3fn), w.T.astype(jnp.float8_e4m3fn)

  def xla_fp8_dot(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

  for name, fn, args, req in (
    ("kernel_fprop", fp8_ptx_probe, (x, w), True),
    ("kernel_train_fprop_dgrad_wgrad", train, (x, w), True),
    ("xla_native_fp8_dot", xla_fp8_dot, (xq, wq), True),
  ):
    try:
      c = precision.check_fp8_in_compiled(fn, *args, platform=plat, require_all=req)
      res[name] = dict(ok=c.ok, stage=c.stage, summary=c.summary())
    except Exception as e:  # pylint: disable=broad-except
      res[name] = dict(ok=False, summary=f"error: {type(e).__name__}: {str(e)[:300]}")
  if interpret:
    res["compiled_gpu"] = "skipped: no GPU (the lowering for 'cuda' was checked instead)"
  if dump_dir and not CUBLASLT_OK:
    try:
      jax.block_until_ready(jax.jit(fp8_ptx_probe)(x, w))
      counts = precision.fp8_checks.ptx_fp8_mma_lines(dump_dir)
      n_files = sum(len([f for f in fs if f.endswith(".ptx")]) for _, _, fs in os.walk(dump_dir))
      res["ptx_fp8_mma_lines"] = counts or f"no FP8 MMA line in {n_files} dumped PTX file(s)"
    except Exception as e:  # pylint: disable=broad-except
      res["ptx_fp8_mma_lines"] = f"error: {type(e).__name__}: {str(e)[:200]}"
  return res


# --- (b) rollout, (c) update, (d) one RL step -------------------------------------------------


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


def _model(name: str, dtype):
  from jetrl.models import get_config, init_params  # pylint: disable=import-outside-toplevel

  cfg = get_config(name)
  return cfg, init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)


def _recipe(name: str, interpret: bool):
  """A recipe as a run gets it; in the CPU smoke test on the XLA path (the interpreted kernel
  is checked by the GEMM part: a whole model in interpret mode takes minutes).

  "<recipe>+fq": the recipe on cuBLASLt with the one-pass quantization kernel (its explicit
  backend makes it a different static argument, so its programs are traced anew, with the
  kernel turned on for that first, tracing call: `_fq_scope`)."""
  base = name.split("+")[0]
  rec = precision.get_recipe(base)
  if interpret:
    return precision.with_gemm_backend(rec, "xla")
  if name.endswith("+fq"):
    return precision.with_gemm_backend(rec, "cublaslt")
  return rec


class _fq_scope:  # pylint: disable=invalid-name
  """Turn the one-pass quantization kernel on while a "+fq" recipe's programs are traced."""

  def __init__(self, name: str):
    self.on = name.endswith("+fq")

  def __enter__(self):
    if self.on:
      gemms.set_fused_quant(True)

  def __exit__(self, *exc):
    if self.on:
      gemms.set_fused_quant(False)


def _profile(fn, steps: int, name: str) -> dict:
  """`fn` once under the profiler (jetrl.kernel_profile), the trace deleted; printed too."""
  from jetrl.kernel_profile import format_summary, profile_call  # pylint: disable=import-outside-toplevel

  d = tempfile.mkdtemp(prefix="jetrl_profile_")
  try:
    s = profile_call(fn, d, steps=steps)
    s.pop("trace", None)
  except Exception as e:  # pylint: disable=broad-except
    s = dict(kernels=0, note=f"profiling failed: {type(e).__name__}: {str(e)[:300]}")
  finally:
    shutil.rmtree(d, ignore_errors=True)
  for ln in format_summary(s):
    print(f"  {name}: {ln}", flush=True)
  return s


def run_rollout(model: str, settings, interpret: bool, recipes=("bf16", "fp8_rollout", "jet")):
  """Sampler tokens/s per recipe, for each (batch, prompt_len, new_tokens) in settings."""
  try:
    from jetrl.sampling import SamplingConfig, sample  # pylint: disable=import-outside-toplevel

    cfg, params = _model(model, jnp.dtype(FLAGS.param_dtype))
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  rows = []
  for batch, prompt_len, new_tokens in settings:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, prompt_len)) for _ in range(batch)]
    scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, prompt_len=prompt_len)
    for name in recipes:
      row = dict(recipe=name, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
      if over_budget(FLAGS.rollout_budget_fraction):
        rows.append(dict(row, skipped="time budget"))
        continue
      rec = _recipe(name, interpret)
      try:
        t0 = time.perf_counter()
        run = lambda: sample(params, cfg, prompts, jax.random.PRNGKey(1), scfg, rec.rollout).tokens
        with _fq_scope(name):
          jax.block_until_ready(run())
        first = time.perf_counter() - t0
        t = call_time(run, max(1, FLAGS.repeats - 1))
        rows.append(
          dict(
            row,
            seconds=t,
            tokens_per_s=batch * new_tokens / t,
            ms_per_step=1e3 * t / new_tokens,
            first_call_s=first,
            compile_s=max(0.0, first - t),
            **memory_gib(),
          )
        )
        if FLAGS.profile:  # per decode step: the prefill's kernels count in too
          rows[-1]["profile"] = _profile(run, new_tokens, f"{name} rollout")
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(row, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
      print(f"  ... {name} {batch}x{prompt_len}+{new_tokens} done at {elapsed():.0f} s", flush=True)
  return rows


def rollout_line(r) -> str:
  head = f"{r.get('recipe', 'rollout'):<12} {r.get('batch', '')}x{r.get('prompt_len', '')}+{r.get('new_tokens', '')}"
  if "skipped" in r:
    return f"{head:<28} skipped: {r['skipped']}"
  sp = f"  {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
  return (
    f"{head:<28} {r['tokens_per_s']:9.0f} tok/s  {r['ms_per_step']:6.2f} ms/step  "
    f"compile {r['compile_s']:5.1f} s{sp}"
  )


def _update_batch(cfg, rows_n, prompt_len, completion_len):
  from jetrl.rl import make_train_batch  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows_n, prompt_len)), jnp.int32)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows_n, completion_len)), jnp.int32)
  ones = lambda shape: jnp.ones(shape, bool)
  return make_train_batch(
    prompt,
    ones(prompt.shape),
    tokens,
    ones(tokens.shape),
    jnp.asarray(-rng.random((rows_n, completion_len)) * 3, jnp.float32),
    jnp.asarray(rng.standard_normal(rows_n), jnp.float32),
  )


def _param_count(params) -> int:
  return int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(params)))


def run_update(
  model: str,
  rows_n: int,
  prompt_len: int,
  completion_len: int,
  interpret: bool,
  recipes=("bf16", "jet"),
):
  try:
    from jetrl.rl import UpdateConfig, init_train_state, update_step  # pylint: disable=import-outside-toplevel
    from jetrl.rl.remat import resolve_remat  # pylint: disable=import-outside-toplevel

    cfg, params = _model(model, jnp.float32)
    batch = _update_batch(cfg, rows_n, prompt_len, completion_len)
    ucfg = UpdateConfig()
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  tokens = rows_n * (prompt_len + completion_len)
  n_params = _param_count(params)
  remat = resolve_remat(ucfg.remat, cfg, rows_n, prompt_len + completion_len - 1)
  rows = []
  for name in recipes:
    row = dict(recipe=name, rows=rows_n, seq=prompt_len + completion_len, remat=remat)
    if over_budget(FLAGS.update_budget_fraction):
      rows.append(dict(row, skipped="time budget"))
      continue
    rec = _recipe(name, interpret)
    try:
      state = init_train_state(params, ucfg)
      times = []
      for i in range(max(2, FLAGS.repeats)):
        t0 = time.perf_counter()
        with _fq_scope(name if i == 0 else ""):
          state, metrics = update_step(
            state, batch, jax.random.PRNGKey(i), model_config=cfg, cfg=ucfg, precision=rec.train
          )
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
      t = float(np.median(times[1:]))
      mfu = 6.0 * n_params * tokens / t / (FLAGS.peak_tflops * 1e12)
      prof = None
      if FLAGS.profile:
        step = lambda s=state: update_step(
          s, batch, jax.random.PRNGKey(0), model_config=cfg, cfg=ucfg, precision=rec.train
        )[1]
        prof = _profile(step, 1, f"{name} update")
      rows.append(
        dict(
          row,
          seconds=t,
          first_call_s=times[0],
          tokens_per_s=tokens / t,
          mfu_6nd=mfu,
          params=n_params,
          finite=bool(float(metrics["skipped_updates"]) == 0),
          **memory_gib(),
          **({"profile": prof} if prof is not None else {}),
        )
      )
      del state
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(row, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"  ... {name} done at {elapsed():.0f} s", flush=True)
  return rows


def update_line(r) -> str:
  head = f"{r.get('recipe', 'update'):<6} {r.get('rows', '')}x{r.get('seq', '')}"
  if "skipped" in r:
    return f"{head:<16} skipped: {r['skipped']}"
  sp = f"  {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
  return (
    f"{head:<16} {1e3 * r['seconds']:9.1f} ms/step ({r['tokens_per_s']:.0f} tok/s, "
    f"MFU {100 * r['mfu_6nd']:.1f}%, peak {r.get('peak_gib', '?')} GiB, "
    f"remat {r['remat']}){sp}"
  )


def run_e2e(
  model: str, prompts_n: int, group: int, prompt_len: int, new_tokens: int, interpret: bool
):
  """One RL step (rollout, reward, advantages, update) per recipe, with the time split."""
  try:
    from jetrl.rl import UpdateConfig, init_train_state, make_train_batch, update_step  # pylint: disable=import-outside-toplevel
    from jetrl.rl.advantages import group_advantages  # pylint: disable=import-outside-toplevel
    from jetrl.sampling import SamplingConfig, sample  # pylint: disable=import-outside-toplevel

    cfg, params = _model(model, jnp.float32)
  except Exception as e:  # pylint: disable=broad-except
    return [dict(skipped=f"{type(e).__name__}: {e}")]
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, cfg.vocab_size, prompt_len)) for _ in range(prompts_n)]
  scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, prompt_len=prompt_len, n=group)
  ucfg = UpdateConfig(micro_batches=FLAGS.e2e_micro_batches)
  rows = []
  for name in ("bf16", "jet"):
    row = dict(recipe=name, prompts=prompts_n, group=group, new_tokens=new_tokens)
    if over_budget(0.97):
      rows.append(dict(row, skipped="time budget"))
      continue
    rec = _recipe(name, interpret)
    try:
      state = init_train_state(params, ucfg)
      splits = []
      for i in range(2):
        t0 = time.perf_counter()
        out = sample(state.params, cfg, prompts, jax.random.PRNGKey(i), scfg, rec.rollout)
        jax.block_until_ready(out.tokens)
        t1 = time.perf_counter()
        # A stand-in verifiable reward: the share of even token ids (host-side, like a task's).
        toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
        reward = ((toks % 2 == 0) & mask).sum(1) / np.maximum(mask.sum(1), 1)
        adv = group_advantages(jnp.asarray(reward, jnp.float32), group)
        batch = make_train_batch(
          out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, adv
        )
        t2 = time.perf_counter()
        state, metrics = update_step(
          state, batch, jax.random.PRNGKey(i), model_config=cfg, cfg=ucfg, precision=rec.train
        )
        jax.block_until_ready(metrics)
        t3 = time.perf_counter()
        splits.append((t1 - t0, t2 - t1, t3 - t2))
      ro, rw, up = splits[-1]
      rows.append(
        dict(
          row,
          seconds=ro + rw + up,
          rollout_s=ro,
          reward_s=rw,
          update_s=up,
          first_step_s=sum(splits[0]),
          mismatch=float(metrics.get("agree/mean_abs_diff", np.nan)),
          **memory_gib(),
        )
      )
      del state
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(row, skipped=f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"  ... {name} done at {elapsed():.0f} s", flush=True)
  return rows


def e2e_line(r) -> str:
  head = f"{r.get('recipe', 'e2e'):<6} {r.get('prompts', '')}x{r.get('group', '')}"
  if "skipped" in r:
    return f"{head:<12} skipped: {r['skipped']}"
  sp = f"  {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
  return (
    f"{head:<12} {r['seconds']:7.2f} s/step = rollout {r['rollout_s']:.2f} + reward "
    f"{r['reward_s']:.2f} + update {r['update_s']:.2f}{sp}"
  )


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


def _settings(text: str):
  """'64x256x256,256x256x256' -> [(64, 256, 256), (256, 256, 256)] (batch x prompt x new)."""
  return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


# --- main ----------------------------------------------------------------------------------


def main(argv):
  del argv
  global CUBLASLT_OK  # pylint: disable=global-statement
  xla_info = setup_xla_flags()
  _imports()
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not FLAGS.allow_cpu:
    print(
      "bench_device: no GPU found (JAX backend: %s). This benchmark measures FP8 on a GPU; "
      "pass --allow_cpu for a CPU smoke test with tiny shapes." % jax.default_backend(),
      file=sys.stderr,
    )
    return 2
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", "")
  fp8_ok = on_gpu and backend.fp8_gpu_available()
  interpret = not on_gpu
  smoke = not on_gpu
  result = dict(
    meta=dict(
      device=f"{dev.device_kind} ({jax.default_backend()}, cc {cc})",
      jax=jax.__version__,
      smoke_test=smoke,
      xla=xla_info,
      peak_tflops=FLAGS.peak_tflops,
    )
  )

  def save():
    result["meta"]["total_s"] = elapsed()
    if FLAGS.json_out:
      with open(FLAGS.json_out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)

  print(
    f"device: {result['meta']['device']}   jax {jax.__version__}   "
    f"XLA extra flags: {xla_info['extra_flags'] or '(none)'}"
  )
  if on_gpu:
    t0 = time.perf_counter()
    reason = cublaslt.unavailable_reason()
    CUBLASLT_OK = reason is None
    result["meta"]["cublaslt"] = dict(cublaslt.info(), load_s=time.perf_counter() - t0)
    print(
      f"cuBLASLt FP8 GEMM: {'ready' if CUBLASLT_OK else 'unavailable: ' + str(reason)} "
      f"{cublaslt.info()}"
    )
  if smoke:
    print("SMOKE TEST on CPU: tiny shapes, kernel in Pallas interpret mode; timings mean nothing.")
  for note in xla_info["notes"]:
    print("note:", note)
  if on_gpu and not fp8_ok:
    print(f"skipped: FP8 parts need compute capability >= 8.9; this GPU has {cc}")

  sections = set(FLAGS.sections)
  if "gemm" in sections and (fp8_ok or smoke):
    models = ["tiny"] if smoke else FLAGS.gemm_models
    prefill = [64] if smoke else [int(v) for v in FLAGS.prefill_m]
    decode = [8] if smoke else [int(v) for v in FLAGS.decode_m]
    print("\n(a) FP8 check")
    result["fp8_check"] = fp8_checks(interpret, None if smoke else xla_info["dump_dir"])
    for k, v in result["fp8_check"].items():
      print(f"  {k:<32} {v.get('summary', v) if isinstance(v, dict) else v}")
    for shape in ((130, 300, 200),) if smoke else ((512, 1536, 8960), (4096, 8960, 1536)):
      try:
        agree = kernel_agreement(interpret, *shape)
      except Exception as e:  # pylint: disable=broad-except
        agree = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      result.setdefault("kernel_agreement", []).append(agree)
      print(f"  kernel vs XLA path (jet GEMMs, float32 between operators): {agree}")
    print("\n(a) GEMMs: TFLOP/s, microseconds, speed-up over bf16 (train_jet: over train_bf16)")
    print(gemm_header())
    result["gemm"] = run_gemms(
      prefill + decode, models, interpret, 1 if smoke else FLAGS.repeats, decode_ms=decode
    )
    save()
  if "rollout" in sections and (fp8_ok or smoke):
    print(f"\n(b) rollout: {FLAGS.model if not smoke else 'tiny'}")
    settings = [(2, 16, 8)] if smoke else _settings(FLAGS.rollout_settings)
    rows = run_rollout(
      "tiny" if smoke else FLAGS.model, settings, interpret, recipes=tuple(FLAGS.rollout_recipes)
    )
    add_speedups(rows, "tokens_per_s", True, group=("batch", "prompt_len", "new_tokens"))
    result["rollout"] = rows
    for r in rows:
      print("  " + rollout_line(r))
    save()
  if "update" in sections and (fp8_ok or smoke):
    print(f"\n(c) update step: {FLAGS.model if not smoke else 'tiny'}")
    rows = (
      run_update("tiny", 2, 16, 16, interpret)
      if smoke
      else run_update(
        FLAGS.model,
        FLAGS.update_rows,
        FLAGS.update_prompt_len,
        FLAGS.update_completion_len,
        interpret,
        recipes=tuple(FLAGS.update_recipes),
      )
    )
    add_speedups(rows, "seconds", False)
    result["update"] = rows
    for r in rows:
      print("  " + update_line(r))
    save()
  if "e2e" in sections and (fp8_ok or smoke):
    print(f"\n(d) one RL step: {FLAGS.model if not smoke else 'tiny'}")
    rows = (
      run_e2e("tiny", 2, 2, 16, 8, interpret)
      if smoke
      else run_e2e(
        FLAGS.model,
        FLAGS.e2e_prompts,
        FLAGS.e2e_group,
        FLAGS.prompt_len,
        FLAGS.new_tokens,
        interpret,
      )
    )
    add_speedups(rows, "seconds", False)
    result["e2e"] = rows
    for r in rows:
      print("  " + e2e_line(r))
  save()
  print(f"\ntotal {elapsed():.0f} s")
  if FLAGS.json_out:
    print(f"wrote {FLAGS.json_out}")
  return 0


if __name__ == "__main__":
  app.run(main)
