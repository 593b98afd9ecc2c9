"""Fit the compiled-program cost model (jetrl.aot.cost) on recorded H200 measurements.

  python experiments/calibrate_cost_model.py                 # fit from the committed kernels
  python experiments/calibrate_cost_model.py --recompile     # compile the programs again first

It compiles, for an H200 from this CPU machine, the programs that the recorded GPU runs in
docs/device timed (experiments/bench_device.py's GEMM loops at M = 4096, the sampler for
qwen2.5-1.5b at 64 x 256 + 256 tokens, the 1.5B update at 16 x 1024 tokens), keeps their
kernels in docs/compile/h200_recorded.json (so a refit needs no compile: --recompile redoes
them, 5 to 15 minutes on two cores), fits the model's constants on one part of the
measurements (--fit: the bf16 and cuBLASLt FP8 GEMMs alone, and the bf16 and fp8_rollout
rollouts, whose kernel counts differ, so that launch cost and bandwidth separate) and prints
the error on every measurement, the held-out ones marked. --write_params stores the fit in
src/jetrl/aot/calibration.json, which the compile report reads.

The programs are compiled as the recorded runs ran them where the code has moved on since:
the decode loop as one loop (the three-segment split came after those runs) and the update
with `--update.old_logp=rollout` (the recomputed old policy, the default since, adds a
forward). --recompile compiles today's code otherwise; where it differs from what ran (the
bf16 `linear`'s backward since the compile report existed), the committed kernels are the
ones that match the measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from jetrl.aot.compile import setup_environment  # noqa: E402

setup_environment()

FLAGS = flags.FLAGS
flags.DEFINE_bool("recompile", False, "Compile the recorded programs again (else read --cache).")
flags.DEFINE_string(
  "cache", str(ROOT / "docs/compile/h200_recorded.json"), "Kernels of the recorded programs."
)
flags.DEFINE_list(
  "runs",
  ["2026-11-30-h200-2", "2026-11-30-h200-3"],
  "docs/device runs whose measurements to use.",
)
flags.DEFINE_list(
  "fit",
  ["gemm:bf16", "gemm:fp8_cublaslt", "rollout:bf16", "rollout:fp8_rollout"],
  "Measurement groups to fit on (the rest are held out).",
)
flags.DEFINE_bool("write_params", False, "Store the fit in src/jetrl/aot/calibration.json.")

GEMM_VARIANTS = ("bf16", "fp8_cublaslt", "linear", "train_bf16", "train_jet")
# Each constant is fitted within a range a GPU can have (a kernel launched on its own costs at
# least 2 us of host launch and gap, one inside a CUDA graph at most 2 us; bandwidth and GEMM
# efficiencies below 95%), so that the few measurements cannot trade one constant for an
# unphysical other.
BOUNDS = {
  "launch_us": (2.0, 10.0),
  "graph_us": (1.0, 20.0),
  "in_graph_us": (0.3, 2.0),
  "iteration_us": (1.0, 30.0),
  "bw_eff": (0.5, 0.95),
  "gemm_eff_bf16": (0.3, 0.95),
  "gemm_eff_fp8": (0.3, 0.95),
}
LOOP_ITERS = 10


def measurements(runs) -> list[dict]:
  """Recorded (group, key, seconds, run) items from docs/device/<run>/bench_device.json."""
  out = []
  for run in runs:
    d = json.loads((ROOT / "docs/device" / run / "bench_device.json").read_text())
    for g in d.get("gemm", []):
      shape = f"{g['m']}x{g['k']}x{g['n']}"
      for v in GEMM_VARIANTS:
        if isinstance(g.get(v), dict) and "us" in g[v]:
          out.append(dict(group=f"gemm:{v}", key=f"gemm:{v}:{shape}", s=g[v]["us"] * 1e-6, run=run))
    for r in d.get("rollout", []):
      if "ms_per_step" in r:
        key = f"rollout:{r['recipe']}:{r['batch']}x{r['prompt_len']}x{r['new_tokens']}"
        out.append(
          dict(group=f"rollout:{r['recipe']}", key=key, s=r["ms_per_step"] * 1e-3, run=run)
        )
    for r in d.get("update", []):
      if "seconds" in r:
        key = f"update:{r['recipe']}:{r['rows']}x{r['seq']}"
        out.append(dict(group=f"update:{r['recipe']}", key=key, s=r["seconds"], run=run))
  return out


def _gemm_program(variant: str, m: int, k: int, n: int, devices):
  """bench_device's timing loop around one GEMM variant, as a Program."""
  import jax
  import jax.numpy as jnp

  from _bench_common import call_loop
  from _bench_gemm import bf16_dot, fp8_block_gemm, linear_grads
  from jetrl import kernels, precision
  from jetrl.aot.programs import Program, one_device_sharding

  rep = one_device_sharding(devices)
  sds = lambda s, d: jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=rep)
  jet = precision.with_gemm_backend(precision.get_recipe("jet"), "cublaslt")
  bf16 = precision.get_recipe("bf16")
  x, w, dy = sds((m, k), jnp.bfloat16), sds((k, n), jnp.bfloat16), sds((m, n), jnp.bfloat16)
  fns = {
    "bf16": (bf16_dot, (x, w)),
    "fp8_cublaslt": (
      fp8_block_gemm,
      (
        sds((m, k), jnp.float8_e4m3fn),
        sds((m, -(-k // 128)), jnp.float32),
        sds((n, k), jnp.float8_e4m3fn),
        sds((-(-n // 128), -(-k // 128)), jnp.float32),
      ),
    ),
    "linear": (lambda a, b: kernels.linear(a, b, jet.rollout), (x, w)),
    "train_bf16": (linear_grads(bf16), (x, w, dy)),
    "train_jet": (linear_grads(jet), (x, w, dy)),
  }
  fn, args = fns[variant]
  run = call_loop(fn, LOOP_ITERS)
  return Program(f"gemm:{variant}:{m}x{k}x{n}", jax.jit(run), args, {})


def compile_recorded(items, target, cache: Path, redo: bool) -> dict:
  """{key: [Compiled.to_json(), ...]} for every recorded measurement's program(s), kept in
  `cache` after each (a key already there is compiled again only with `redo`)."""
  from jetrl.aot import programs
  from jetrl.aot.compile import compile_program
  from jetrl.aot import tracing_for
  from jetrl.aot.targets import devices
  from jetrl.models import get_config
  from jetrl.precision import get_recipe
  from jetrl.rl import UpdateConfig

  devs = devices(target)
  cfg = get_config("qwen2.5-1.5b")
  out = json.loads(cache.read_text()) if cache.exists() else {}
  for key in sorted({i["key"] for i in items}):
    if key in out and not redo:
      continue
    kind, name, size = key.split(":")
    t0 = time.perf_counter()
    # Traced for the target as code outside jetrl is (`tracing_for`): the GEMM loops are the
    # GPU benchmark's own functions, which resolve their plans for the device traced for.
    with tracing_for(target) as tracing:
      if kind == "gemm":
        m, k, n = (int(v) for v in size.split("x"))
        progs = [_gemm_program(name, m, k, n, devs)]
      elif kind == "rollout":
        b, p, t = (int(v) for v in size.split("x"))
        progs = programs.rollout_programs(
          cfg,
          get_recipe(name),
          devs,
          device=tracing.device,
          batch=b,
          prompt_len=p,
          new_tokens=t,
          segments=(t,),
        )
      else:
        rows, seq = (int(v) for v in size.split("x"))
        progs = [
          programs.update_program(
            cfg,
            get_recipe(name),
            devs,
            device=tracing.device,
            rows=rows,
            prompt_len=seq // 2,
            completion_len=seq // 2,
            update=UpdateConfig(old_logp="rollout"),
          )
        ]
      out[key] = [compile_program(p, target).to_json() for p in progs]
    print(f"  compiled {key} in {time.perf_counter() - t0:.0f} s", flush=True)
    cache.write_text(json.dumps(out, indent=1) + "\n")
  return out


def predicted_seconds(key: str, compiled: list, target, params) -> float:
  """The model's seconds for what the measurement `key` timed."""
  from jetrl.aot import cost

  if key.startswith("gemm:"):  # one iteration of the timing loop (its set-up is negligible)
    (c,) = compiled
    return cost.program_seconds(c.launches, target, params) / LOOP_ITERS
  total = sum(cost.program_seconds(c.launches, target, params) for c in compiled)
  if key.startswith("rollout:"):  # the whole sample() call per new token
    return total / int(key.split("x")[-1])
  return total


def _say(line: str) -> None:
  print(line, flush=True)


def main(argv):
  del argv
  from jetrl.aot import cost
  from jetrl.aot.compile import Compiled
  from jetrl.aot.targets import get_target
  from jetrl.train.progress import ticking

  target = get_target("h200")
  items = measurements(FLAGS.runs)
  cache = Path(FLAGS.cache)
  keys = {i["key"] for i in items}
  data = json.loads(cache.read_text()) if cache.exists() else {}
  if FLAGS.recompile or not keys <= set(data):
    cache.parent.mkdir(parents=True, exist_ok=True)
    with ticking(f"compiling the recorded programs for {target.name}", _say):
      data = compile_recorded(items, target, cache, FLAGS.recompile)
  compiled = {k: [Compiled.from_json(c) for c in v] for k, v in data.items()}
  fit_items = [i for i in items if i["group"] in FLAGS.fit]
  if not fit_items:
    raise app.UsageError(f"--fit={FLAGS.fit} matches no measurement")

  def loss_items(params):
    return [
      (predicted_seconds(i["key"], compiled[i["key"]], target, params), i["s"]) for i in fit_items
    ]

  import numpy as np
  from scipy.optimize import minimize

  names = [n for n in cost.CostParams().as_dict() if n in BOUNDS]  # the rest are measured
  lo = np.log([BOUNDS[n][0] for n in names])
  hi = np.log([BOUNDS[n][1] for n in names])

  def params_of(x):
    x = np.clip(x, lo, hi)
    return dataclasses.replace(
      cost.load_params()[0], **{n: float(np.exp(v)) for n, v in zip(names, x)}
    )

  def loss(x):
    return float(np.mean([math.log(p / s) ** 2 for p, s in loss_items(params_of(x))]))

  best = None
  for start in (0.25, 0.5, 0.75):  # a few starts inside the bounds; the best fit is kept
    x0 = lo + start * (hi - lo)
    res = minimize(
      loss, x0, method="Nelder-Mead", options=dict(maxiter=8000, xatol=1e-6, fatol=1e-10)
    )
    if best is None or res.fun < best.fun:
      best = res
  res = best
  params = params_of(res.x)
  rows, errs = [], {"fit": [], "held_out": []}
  for i in items:
    pred = predicted_seconds(i["key"], compiled[i["key"]], target, params)
    err = pred / i["s"] - 1
    role = "fit" if i["group"] in FLAGS.fit else "held_out"
    errs[role].append(abs(err))
    rows.append(dict(i, estimate_s=pred, error=err, role=role))
  print(f"\nfitted on {', '.join(FLAGS.fit)} ({len(fit_items)} measurements):")
  for n, v in params.as_dict().items():
    print(f"  {n:<14} {v:.4g}")
  print("\n| measurement | run | measured | estimated | error | role |\n|---|---|---|---|---|---|")
  for r in rows:
    unit, scale = ("us", 1e6) if r["s"] < 1e-3 else ("ms", 1e3)
    print(
      f"| {r['key']} | {r['run'][-1]} | {r['s'] * scale:.1f} {unit} | "
      f"{r['estimate_s'] * scale:.1f} {unit} | {100 * r['error']:+.0f}% | {r['role']} |"
    )
  summary = {
    role: dict(n=len(e), median_abs=float(np.median(e)), max_abs=float(np.max(e)))
    for role, e in errs.items()
    if e
  }
  for role, s in summary.items():
    print(
      f"{role}: {s['n']} measurements, median |error| {100 * s['median_abs']:.0f}%, "
      f"max {100 * s['max_abs']:.0f}%"
    )
  if FLAGS.write_params:
    rec = dict(
      params=params.as_dict(),
      target=target.name,
      fit=FLAGS.fit,
      runs=FLAGS.runs,
      errors=summary,
      rows=[{k: r[k] for k in ("key", "run", "s", "estimate_s", "error", "role")} for r in rows],
      command=" ".join(["python"] + sys.argv),
    )
    cost.CALIBRATION.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {cost.CALIBRATION}")


if __name__ == "__main__":
  app.run(main)
