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
--rollout_fused_quant / --update_fused_quant also time recipes with the one-pass quantization
kernel (rows "<recipe>+fq"); --rollout_decode_gemm also with the Pallas decode GEMM
(JETRL_DECODE_GEMM=pallas; rows "<recipe>+fq+pd"); --update_unfused_mlp with the one-pass
kernel but the MLP and the norms unfused (JETRL_FUSED_MLP=0; rows "<recipe>+fq-mlp"). The parts live in _bench_gemm.py (a) and _bench_steps.py (b-d),
over _bench_common.py.

Without a GPU it exits with code 2 unless --allow_cpu is given; then it runs tiny shapes with the
kernel in Pallas interpret mode, as a smoke test whose timings mean nothing.
"""

from __future__ import annotations

import json
import os
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
flags.DEFINE_list("rollout_recipes", ["bf16", "fp8_rollout", "jet"], "Rollout recipes.")
flags.DEFINE_list(
  "rollout_fused_quant",
  [],
  "Recipes whose rollout is also timed on cuBLASLt with the one-pass quantization kernel "
  "(reported as <recipe>+fq).",
)
flags.DEFINE_list(
  "rollout_decode_gemm",
  [],
  "Recipes whose rollout is also timed with the one-pass quantization and the Pallas decode "
  "GEMM (JETRL_DECODE_GEMM=pallas; reported as <recipe>+fq+pd).",
)
flags.DEFINE_list(
  "rollout_kv_cache",
  [],
  "Recipes whose rollout is also timed with the one-pass quantization and an FP8 KV cache "
  "(--kv_cache=fp8; reported as <recipe>+fq+kv8).",
)
flags.DEFINE_list("update_recipes", ["bf16", "jet"], "Update recipes.")
flags.DEFINE_enum(
  "update_master_dtype",
  "float32",
  ["float32", "bfloat16"],
  "The update's --update.master_dtype: float32 master weights and AdamW moments, or bf16 "
  "(the paper's setting at 8B, where float32 masters and moments do not fit one GPU).",
)
flags.DEFINE_list(
  "update_fused_quant",
  [],
  "Recipes whose update step is also timed on cuBLASLt with the one-pass quantization "
  "kernel (reported as <recipe>+fq).",
)
flags.DEFINE_list(
  "update_unfused_mlp",
  [],
  "Recipes whose update step is also timed with the one-pass quantization kernel but the "
  "MLP and the norms unfused (JETRL_FUSED_MLP=0; reported as <recipe>+fq-mlp): against "
  "<recipe>+fq, what "
  "SwiGLU's FP8 kernels (jetrl.kernels.mlp) save.",
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


def _check_recipes(fq_flag: str):
  """A validator of a list of recipe names (jetrl.precision.RECIPES)."""

  def check(names):
    from jetrl.precision import RECIPES  # pylint: disable=import-outside-toplevel

    bad = [r for r in names if r not in RECIPES]
    if bad:
      hint = f" (for '<recipe>+fq', give the recipe in --{fq_flag})" if "+fq" in str(bad) else ""
      raise flags.ValidationError(f"unknown {bad}; accepted: {list(RECIPES)}{hint}")
    return True

  return check


for _name, _fq in (
  ("rollout_recipes", "rollout_fused_quant"),
  ("rollout_fused_quant", "rollout_fused_quant"),
  ("rollout_decode_gemm", "rollout_decode_gemm"),
  ("update_recipes", "update_fused_quant"),
  ("update_fused_quant", "update_fused_quant"),
  ("update_unfused_mlp", "update_unfused_mlp"),
):
  flags.register_validator(_name, _check_recipes(_fq))


def _check_kv_cache_recipes(names):
  from jetrl.precision import KV_CACHE_RECIPES  # pylint: disable=import-outside-toplevel

  bad = [r for r in names if r not in KV_CACHE_RECIPES]
  if bad:
    raise flags.ValidationError(
      f"an FP8 KV cache is not a choice of {bad}; accepted: {list(KV_CACHE_RECIPES)}"
    )
  return True


flags.register_validator("rollout_kv_cache", _check_kv_cache_recipes)

_T0 = time.perf_counter()


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


def _variants(
  recipes_flag: str, fq_flag: str, pd_flag: str = "", mlp_flag: str = "", kv_flag: str = ""
):
  """The variants of the flags: recipes, recipes also run with the one-pass kernel, (the
  rollout) with the Pallas decode GEMM too or an FP8 KV cache, and (the update) with the MLP
  unfused."""
  from _bench_common import variants  # pylint: disable=import-outside-toplevel

  pd = getattr(FLAGS, pd_flag) if pd_flag else ()
  mlp = getattr(FLAGS, mlp_flag) if mlp_flag else ()
  kv = getattr(FLAGS, kv_flag) if kv_flag else ()
  return variants(getattr(FLAGS, recipes_flag), getattr(FLAGS, fq_flag), pd, mlp, kv)


def _update_shape():
  return FLAGS.update_rows, FLAGS.update_prompt_len, FLAGS.update_completion_len


def _e2e_shape():
  return FLAGS.e2e_prompts, FLAGS.e2e_group, FLAGS.prompt_len, FLAGS.new_tokens


def main(argv):
  del argv
  xla_info = setup_xla_flags()
  # Imported after XLA_FLAGS is set (importing does not start the backend; be explicit anyway).
  import jax  # pylint: disable=import-outside-toplevel

  import _bench_common as common  # pylint: disable=import-outside-toplevel

  common.start_clock(_T0)
  from _bench_common import add_speedups, elapsed  # pylint: disable=import-outside-toplevel
  from _bench_gemm import fp8_checks, gemm_header, kernel_agreement, run_gemms  # pylint: disable=import-outside-toplevel
  from _bench_steps import result_line, run_e2e, run_rollout, run_update, settings  # pylint: disable=import-outside-toplevel
  from jetrl.kernels import backend, cublaslt  # pylint: disable=import-outside-toplevel

  rollout_variants = _variants(
    "rollout_recipes", "rollout_fused_quant", "rollout_decode_gemm", kv_flag="rollout_kv_cache"
  )
  update_variants = _variants("update_recipes", "update_fused_quant", mlp_flag="update_unfused_mlp")
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
    common.CUBLASLT_OK = reason is None
    result["meta"]["cublaslt"] = dict(cublaslt.info(), load_s=time.perf_counter() - t0)
    print(
      f"cuBLASLt FP8 GEMM: {'ready' if common.CUBLASLT_OK else 'unavailable: ' + str(reason)} "
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
        agree = {"error": common.error_text(e)}
      result.setdefault("kernel_agreement", []).append(agree)
      print(f"  kernel vs XLA path (jet GEMMs, float32 between operators): {agree}")
    print("\n(a) GEMMs: TFLOP/s, microseconds, speed-up over bf16 (train_jet: over train_bf16)")
    print(gemm_header())
    result["gemm"] = run_gemms(
      prefill + decode, models, interpret, 1 if smoke else FLAGS.repeats, decode_ms=decode
    )
    save()
  model = "tiny" if smoke else FLAGS.model
  # (section, title, run, speed-up: key, larger is better, rows compared by)
  parts = (
    (
      "rollout",
      "(b) rollout",
      lambda: run_rollout(
        model,
        [(2, 16, 8)] if smoke else settings(FLAGS.rollout_settings),
        interpret,
        variants=rollout_variants,
      ),
      ("tokens_per_s", True, ("batch", "prompt_len", "new_tokens")),
    ),
    (
      "update",
      "(c) update step",
      lambda: run_update(
        model,
        *((2, 16, 16) if smoke else _update_shape()),
        interpret,
        variants=common.variants(("bf16", "jet")) if smoke else update_variants,
      ),
      ("seconds", False, ()),
    ),
    (
      "e2e",
      "(d) one RL step",
      lambda: run_e2e(
        model,
        *((2, 2, 16, 8) if smoke else _e2e_shape()),
        interpret,
      ),
      ("seconds", False, ()),
    ),
  )
  for section, title, run, (key, larger, group) in parts:
    if section not in sections or not (fp8_ok or smoke):
      continue
    print(f"\n{title}: {model}")
    rows = run()
    add_speedups(rows, key, larger, group=group)
    result[section] = rows
    for r in rows:
      print("  " + result_line(section, r))
    if section != "e2e":
      save()
  save()
  print(f"\ntotal {elapsed():.0f} s")
  if FLAGS.json_out:
    print(f"wrote {FLAGS.json_out}")
  return 0


if __name__ == "__main__":
  app.run(main)
