"""One projection compiled for an accelerator this machine lacks: bf16 against jet's FP8.

  python experiments/compile_linear.py --target=h200 --model=qwen2.5-1.5b --m=64,256,4096,16384

For each projection shape of the model (fused q / k / v, o, fused gate / up, down) and each
row count M it compiles, for the target (jetrl.aot), three rollout programs and prints their
kernels, HBM bytes and the cost model's ESTIMATED time (jetrl.aot.cost, calibrated on
recorded H200 runs; not a measurement):

  bf16          `linear(x, w)` under the bf16 recipe's rollout precision;
  jet           `linear(x, wq)` under jet's: quantizing x (1 x 128 groups) and the FP8 GEMM,
                wq the rollout's FP8 weight (quantized once per rollout, not in the program);
  jet, x given  the FP8 GEMM alone, from x already quantized (`QuantizedInput`: what a decode
                step's fused kernels hand over, models/decode_fused.py).

The columns the FP8-speed targets read: jet's time over the GEMM alone's (quantization's
overhead; "quantize + GEMM >= 0.9x the GEMM alone" is gemm / jet >= 0.9), and at decode sizes
jet's bytes and kernels from a given x against bf16's. Runs in the aot environment
(`make aot`, `.venv-aot`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from jetrl.aot.compile import setup_environment  # noqa: E402

setup_environment()

from jetrl.aot.targets import TARGETS  # noqa: E402

FLAGS = flags.FLAGS
GPUS = [name for name, t in TARGETS.items() if t.platform == "gpu" and t.devices == 1]
flags.DEFINE_enum("target", "h200", GPUS, "Compile-only GPU (one device).")
flags.DEFINE_string("model", "qwen2.5-1.5b", "A model preset (its projection shapes).")
flags.DEFINE_list("m", ["64", "256", "4096", "16384"], "Rows (tokens) of x.")


def _shapes(cfg) -> list[tuple[str, int, int]]:
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  d, f = cfg.d_model, cfg.d_ff
  return [("qkv", d, q + 2 * kv), ("o", q, d), ("gate_up", d, 2 * f), ("down", f, d)]


def main(argv):
  del argv
  try:
    ms = [int(m) for m in FLAGS.m]
  except ValueError:
    raise app.UsageError(f"--m: comma-separated row counts, got {FLAGS.m!r}")
  if not ms or min(ms) < 1:
    raise app.UsageError(f"--m: row counts of at least 1, got {FLAGS.m!r}")
  import jax
  import jax.numpy as jnp

  from jetrl.aot import cost
  from jetrl.aot.compile import compile_program, estimate_seconds
  from jetrl.aot.programs import Program, one_device_sharding
  from jetrl.aot import tracing_for
  from jetrl.aot.targets import devices, get_target
  from jetrl.models import PRESETS, get_config
  from jetrl.precision import get_recipe, prequantize_weight
  from jetrl.kernels.gemms import with_gemm_scales

  if FLAGS.model.lower() not in PRESETS:
    raise app.UsageError(f"--model: one of {sorted(PRESETS)}, got {FLAGS.model!r}")
  cfg = get_config(FLAGS.model)
  target = get_target(FLAGS.target)
  rep = one_device_sharding(devices(target))
  params, _ = cost.load_params()
  bf16, jet = get_recipe("bf16").rollout, get_recipe("jet").rollout
  g = jet.fprop
  fp8 = jnp.float8_e4m3fn
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  abstract = lambda tree: jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype), tree)

  def run(name, fn, *args):
    c = compile_program(Program(name, jax.jit(fn), args, {}), target)
    n = sum(k.count for k in c.launches.kernels)
    mb = sum(k.bytes * k.count for k in c.launches.kernels) / 1e6
    return n, mb, estimate_seconds(c, target, params) * 1e6

  print(f"{FLAGS.model} projections compiled for {target.name}: kernels, MB and ESTIMATED us")
  print("(cost model, not a measurement); jet's FP8 weight quantized once, outside the program.")
  print()
  print("| proj | M x K x N | bf16 | jet | jet, x given | gemm / jet | jet / bf16 time |"
        " bytes, x given / bf16 |")  # fmt: skip
  print("|---|---|---|---|---|---:|---:|---:|")
  # Traced for the target: `linear` is called here as code outside jetrl calls it, with no plan.
  with tracing_for(target):
    _rows(cfg, ms, sds, abstract, run, g, fp8, bf16, jet, with_gemm_scales, prequantize_weight)
  return 0


def _rows(cfg, ms, sds, abstract, run, g, fp8, bf16, jet, with_gemm_scales, prequantize_weight):
  import jax
  import jax.numpy as jnp

  from jetrl.kernels import linear
  from jetrl.precision import QuantizedInput

  for name, k, n in _shapes(cfg):
    w = sds((k, n), jnp.bfloat16)
    # the rollout weight as a GPU rollout holds it
    wq = abstract(jax.eval_shape(lambda a: with_gemm_scales(prequantize_weight(a, g, k_major=True), g), w))  # fmt: skip
    for m in ms:
      x = sds((m, k), jnp.bfloat16)
      xq = QuantizedInput(sds((m, k), fp8), sds((-(-k // 128), m), jnp.float32))
      b = run("bf16", lambda a, b: linear(a, b, bf16), x, w)
      j = run("jet", lambda a, b: linear(a, b, jet), x, wq)
      jg = run("jet_given", lambda a, b: linear(a, b, jet), xq, wq)
      cell = lambda r: f"{r[0]} / {r[1]:.1f} MB / {r[2]:.1f} us"
      print(
        f"| {name} | {m}x{k}x{n} | {cell(b)} | {cell(j)} | {cell(jg)} | {jg[2] / j[2]:.2f} |"
        f" {j[2] / b[2]:.2f}x | {jg[1] / b[1]:.2f} |"
      )


if __name__ == "__main__":
  app.run(main)
