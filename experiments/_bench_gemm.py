"""bench_device part (a): FP8 GEMM throughput on a preset's linear layers against bf16, the
kernel's agreement with the XLA path, and the FP8-in-the-compiled-program check."""

from __future__ import annotations

import os

from absl import flags

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import _bench_common as common
import jetrl.precision as precision
from _bench_common import error_text, kernel_backend, loop_time, over_budget, with_fused_quant
from jetrl import kernels
from jetrl.kernels import backend, cublaslt
from jetrl.kernels import gemm_pallas as gp
from jetrl.kernels import quant_kernel as qk

FLAGS = flags.FLAGS


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


def bf16_dot(a, b):
  """XLA's bf16 dot of [M, K] x [K, N] (cuBLAS), bf16 out."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def fp8_block_gemm(a, sa, b, sb):
  """cuBLASLt's blockwise FP8 GEMM of quantized [M, K] rows and [N, K] 128x128 blocks."""
  return cublaslt.gemm(a, sa, b, sb, b_blocks=True, out_dtype=jnp.bfloat16)


def linear_grads(recipe):
  """f(x, w, dy): both gradients of `linear` under the recipe's training precision."""
  return lambda a, b, d: jax.vjp(lambda a_, b_: kernels.linear(a_, b_, recipe.train), a, b)[1](d)


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
  kernel = kernel_backend(interpret)
  jet = precision.with_gemm_backend(precision.get_recipe("jet"), kernel)
  bf16 = precision.get_recipe("bf16")
  out = {
    "bf16": (bf16_dot, (x, w)),
    "fp8_tensor": (
      lambda a, b, s: (
        lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * s
      ).astype(jnp.bfloat16),
      (tq, uq, ts[0, 0] * us[0, 0]),
    ),
  }
  if common.CUBLASLT_OK:
    out["fp8_cublaslt"] = (fp8_block_gemm, (xq, xs, wq, ws))
  if FLAGS.pallas or not common.CUBLASLT_OK:
    for i, t in enumerate(tiles_list):
      name = "fp8_pallas" if len(tiles_list) == 1 else f"fp8_pallas@{i}"
      ws_rows = jnp.repeat(ws, 128, axis=0)[:n]
      out[name] = (
        lambda a, sa, b, sb, t=t: gp.scaled_matmul_nt(
          a, sa, b, sb, out_dtype=jnp.bfloat16, interpret=interpret, tiles=t
        ),
        (xq, xs, wq, ws_rows),
      )
  fq = with_fused_quant
  if decode:
    qw = precision.prequantize_weight(
      w, jet.rollout.fprop, k_major=backend.wants_k_major(jet.rollout.fprop)
    )
    out["linear"] = (lambda a, q: kernels.linear(a, q, jet.rollout), (x, qw))
    if common.CUBLASLT_OK:
      out["linear_fq"] = (fq(lambda a, q: kernels.linear(a, q, jet.rollout)), (x, qw))
  else:
    out["linear"] = (lambda a, b: kernels.linear(a, b, jet.rollout), (x, w))
    if common.CUBLASLT_OK:
      out["linear_fq"] = (fq(lambda a, b: kernels.linear(a, b, jet.rollout)), (x, w))
      out["quantize_x"] = (lambda a: precision.quantize(a, (1, 128)), (x,))
      out["quantize_x_fq"] = (
        lambda a: qk.quantize_rows_cols(a, jnp.float8_e4m3fn, cols=False),
        (x,),
      )
      out["quantize_x_rows_cols_fq"] = (lambda a: qk.quantize_rows_cols(a, jnp.float8_e4m3fn), (x,))
    for name, rec in (("train_bf16", bf16), ("train_jet", jet)):
      out[name] = (linear_grads(rec), (x, w, dy))
    if common.CUBLASLT_OK:
      out["train_jet_fq"] = (fq(linear_grads(jet)), (x, w, dy))
  return out


GEMM_FLOP_MULT = {"train_bf16": 3.0, "train_jet": 3.0, "train_jet_fq": 3.0}
PROFILE_ITERS = 20


def kernel_time(fn, args, name: str) -> dict:
  """At decode sizes a call's wall time in a loop is mostly its launch and the loop's round
  trip, where a decode step runs its GEMMs inside a CUDA graph: the device time of the call's
  own kernels, from the profiler over PROFILE_ITERS calls (`kernel_us`, the loop counter's
  small kernels included, the same for every variant; `kernels` a call)."""
  run = jax.jit(common.call_loop(fn, PROFILE_ITERS))
  jax.block_until_ready(run(*args))
  s = common.profile(lambda: jax.block_until_ready(run(*args)), PROFILE_ITERS, name)
  if not s.get("kernels"):
    return dict(kernel_note=s.get("note", "no kernels"))
  return dict(kernel_us=1e3 * s["busy_ms"] / PROFILE_ITERS, kernels=s["kernels_per_step"])


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
            if decode and FLAGS.profile:
              row[var].update(kernel_time(fn, args, f"{model} {name} {m} {var}"))
          except Exception as e:  # pylint: disable=broad-except
            row[var] = dict(error=error_text(e))
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
  kern = kernel_backend(interpret)
  for be in ("xla", kern):
    p = precision.with_gemm_backend(p32, be)
    f = jax.jit(
      lambda a, b, d, p=p: (lambda y, vjp: (y,) + vjp(d))(
        *jax.vjp(lambda a_, b_: kernels.linear(a_, b_, p), a, b)
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
    precision.get_recipe("jet").train, "pallas" if interpret else kernel_backend(False)
  )
  res = {}

  def fp8_ptx_probe(a, b):
    return kernels.linear(a, b, jet)

  def train(a, b):
    return jax.grad(
      lambda a_, b_: kernels.linear(a_, b_, jet).astype(jnp.float32).sum(), argnums=(0, 1)
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
  if dump_dir and not common.CUBLASLT_OK:
    try:
      jax.block_until_ready(jax.jit(fp8_ptx_probe)(x, w))
      counts = precision.fp8_checks.ptx_fp8_mma_lines(dump_dir)
      n_files = sum(len([f for f in fs if f.endswith(".ptx")]) for _, _, fs in os.walk(dump_dir))
      res["ptx_fp8_mma_lines"] = counts or f"no FP8 MMA line in {n_files} dumped PTX file(s)"
    except Exception as e:  # pylint: disable=broad-except
      res["ptx_fp8_mma_lines"] = f"error: {type(e).__name__}: {str(e)[:200]}"
  return res
