"""Time `jetrl.precision.linear` per recipe on LLM-shaped GEMMs and print ratios to bf16.

  python experiments/bench_precision.py                       # default shapes
  python experiments/bench_precision.py --shapes=2048x1024x4096 --repeats=5 --json_out=bench.json

Forward is the rollout forward (`recipe.rollout`); forward+backward is `jax.grad` under
`recipe.train` (for fp8_rollout that is bf16). On a CPU, FP8 is emulated (quantize, then a
float32 GEMM on the dequantized values), so this measures the emulation's cost, not FP8 speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared fields

from _fields import json_out_field, recipes_field  # noqa: E402
from jetrl.config import ConfigError, check_fields, field  # noqa: E402
from jetrl.kernels import linear  # noqa: E402
from jetrl.precision import RECIPES, get_recipe  # noqa: E402
from jetrl.train.cli import main  # noqa: E402
from jetrl.train.config import Tree  # noqa: E402


def parse_shape(text: str) -> tuple[int, int, int]:
  parts = text.lower().split("x")
  if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ConfigError(
      "shapes", f"entry {text!r} must be MxKxN with positive integers, e.g. 2048x1024x4096"
    )
  return tuple(int(p) for p in parts)


@dataclasses.dataclass(frozen=True)
class BenchPrecisionConfig(Tree):
  """experiments/bench_precision.py's settings."""

  shapes: tuple[str, ...] = field(
    ("2048x1024x4096", "512x2048x2048", "32x2048x2048"),
    "GEMM shapes as MxKxN (M tokens, K in, N out).",
  )
  recipes: tuple[str, ...] = recipes_field(tuple(RECIPES), "Recipes to time.")
  repeats: int = field(5, "Timed repetitions per measurement (the median is reported).", lo=1)
  json_out: Optional[str] = json_out_field()

  def __post_init__(self):
    check_fields(self)
    for s in self.shapes:
      parse_shape(s)


def _time(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def bench(shapes, recipes, repeats):
  rows = []
  for m, k, n in shapes:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32) * 0.02
    dy = jax.random.normal(jax.random.PRNGKey(2), (m, n), jnp.bfloat16)
    for name in recipes:
      r = get_recipe(name)
      fwd = jax.jit(lambda a, b, p=r.rollout: linear(a, b, p))

      def fwd_bwd(a, b, g, p=r.train):
        y, vjp = jax.vjp(lambda a_, b_: linear(a_, b_, p), a, b)
        return y, vjp(g.astype(y.dtype))

      fwd_bwd = jax.jit(fwd_bwd)
      t_f = _time(fwd, x, w, repeats=repeats)
      t_fb = _time(fwd_bwd, x, w, dy, repeats=repeats)
      rows.append(
        dict(
          shape=f"{m}x{k}x{n}",
          recipe=name,
          fwd_ms=1e3 * t_f,
          fwd_bwd_ms=1e3 * t_fb,
          fwd_gflops=2 * m * k * n / t_f / 1e9,
        )
      )
      print(
        f"  {m}x{k}x{n} {name:<12} fwd {1e3 * t_f:8.1f} ms   fwd+bwd {1e3 * t_fb:8.1f} ms",
        flush=True,
      )
  for row in rows:
    base = next((b for b in rows if b["shape"] == row["shape"] and b["recipe"] == "bf16"), None)
    row["fwd_vs_bf16"] = row["fwd_ms"] / base["fwd_ms"] if base else float("nan")
    row["fwd_bwd_vs_bf16"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base else float("nan")
  return rows


def table(rows) -> str:
  lines = [
    "| shape MxKxN | recipe | fwd ms | fwd+bwd ms | fwd / bf16 | fwd+bwd / bf16 |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['shape']} | {r['recipe']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
      f"{r['fwd_vs_bf16']:.2f} | {r['fwd_bwd_vs_bf16']:.2f} |"
    )
  return "\n".join(lines)


def run(c: BenchPrecisionConfig) -> None:
  shapes = [parse_shape(s) for s in c.shapes]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device(s))")
  rows = bench(shapes, c.recipes, c.repeats)
  print()
  print(table(rows))
  if c.json_out:
    with open(c.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(BenchPrecisionConfig(), run, doc=__doc__)
