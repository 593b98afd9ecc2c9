"""What jetrl's programs would run on an accelerator this machine lacks: the compile report.

  python experiments/compile_report.py --target=h200 --model=qwen2.5-1.5b --recipe=jet
  python experiments/compile_report.py --target=tpu-v5e --model=qwen2.5-1.5b --recipe=bf16
  python experiments/compile_report.py --target=8xh200 --model=llama-3.1-8b --recipe=jet \\
      --programs=update --mesh=fsdp:8

It compiles, for the target (`jetrl.aot.targets`: h100, h200, 8xh200, tpu-v5e, tpu-v5e-8,
tpu-v5p, tpu-v6e, tpu-v4, tpu7x, tpu7x-8), the jitted programs the product runs: the sampler's
rollout weights, prefill and decode loop, the RL update step (forward, loss, backward,
AdamW) and the SFT step, and prints per program and per decode step: kernels by kind, the top
kernels by bytes and FLOPs, HBM bytes and FLOPs, the memory plan and whether it fits, the
collectives on a mesh, and the cost model's estimated time (an ESTIMATE: jetrl.aot.cost,
calibrated on recorded H200 runs). Needs `pip install -e '.[aot]'` (make aot). The GPU
benchmark's XLA flags are set (--xla_gpu_enable_triton_gemm=false) unless XLA_FLAGS sets them.
The kernel settings are a run's `--kernels.*` flags (`--kernels.fused_mlp=false`,
`--kernels.decode_gemm=pallas`, ...), their defaults from the JETRL_* variables where set
(jetrl.kernels.device); the JSON output records them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dataclasses

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from jetrl.aot.compile import setup_environment  # noqa: E402

setup_environment()

from jetrl.aot.targets import TARGETS  # noqa: E402
from jetrl.rl.update_config import OLD_LOGP_SOURCES  # noqa: E402
from jetrl.rl.remat import REMAT_POLICIES  # noqa: E402

from jetrl.config import FlagError, node  # noqa: E402
from jetrl.config.flags import config_from_flags, define_flags  # noqa: E402
from jetrl.kernels import KernelConfig  # noqa: E402
from jetrl.kernels.device import kernel_defaults  # noqa: E402
from jetrl.train.config import KERNELS_HELP  # noqa: E402


@dataclasses.dataclass(frozen=True)
class KernelFlags:
  """The report's `--kernels.*` flags: a run's kernel settings node."""

  kernels: KernelConfig = node(KernelConfig, KERNELS_HELP)


try:  # the JETRL_* variables give the defaults, as in a run
  KERNEL_DEFAULTS, KERNEL_NOTES = kernel_defaults(KernelFlags())
except ValueError as e:
  sys.exit(f"{Path(sys.argv[0]).name}: error: {e}")

FLAGS = flags.FLAGS
define_flags(KERNEL_DEFAULTS, FLAGS, module_name=sys.argv[0], config_file=False)
flags.DEFINE_enum("target", "h200", list(TARGETS), "Compile-only device (and how many).")
flags.DEFINE_string("model", "qwen2.5-1.5b", "A model preset, or a Hugging Face model folder.")
flags.DEFINE_integer("layers", None, "Keep only the first N layers (quick looks, tests).")
flags.DEFINE_string("recipe", "jet", "Precision recipe (jetrl.precision.RECIPES).")
flags.DEFINE_enum(
  "kv_cache",
  "compute",
  ["compute", "fp8"],
  "The rollout's KV cache: in the compute dtype, or FP8 (E4M3 with 1x128 scales; the recipes "
  "of jetrl.precision.KV_CACHE_RECIPES), as --kv_cache of a run.",
)
flags.DEFINE_list("programs", ["rollout", "update"], "Programs: rollout, update, sft.")
flags.DEFINE_integer("batch", 64, "Rollout rows (prompts x samples).")
flags.DEFINE_integer("prompt_len", 256, "Rollout prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 256, "Rollout generated tokens per row.")
flags.DEFINE_integer("rows", 16, "Update / SFT rows.")
flags.DEFINE_integer("seq", 1024, "Update / SFT tokens per row (half prompt, half completion).")
flags.DEFINE_string("mesh", "", "Mesh of a multi-device target's update, e.g. fsdp:8 (--mesh).")
flags.DEFINE_integer(
  "lora_rank", 0, "The update of a LoRA run (--lora.rank; all seven projections); 0: full."
)
flags.DEFINE_float("lora_alpha", 16.0, "--lora.alpha of the LoRA update.")
flags.DEFINE_enum(
  "master_dtype", "float32", ["float32", "bfloat16"], "The update's --update.master_dtype."
)
flags.DEFINE_enum(
  "remat",
  "auto",
  list(REMAT_POLICIES),
  "The update's --update.remat (auto: per-layer recompute when the activations would take more "
  "than a quarter of the target's memory).",
)
flags.DEFINE_enum(
  "old_logp",
  "auto",
  list(OLD_LOGP_SOURCES),
  "--update.old_logp of the update (recompute: the pre-update forward of the earlier reports).",
)
flags.DEFINE_string("param_dtype", "bfloat16", "Stored dtype of the params the rollout reads.")
flags.DEFINE_integer("top", 5, "Top kernels listed by bytes and by FLOPs.")
flags.DEFINE_string("json_out", "", "Write the figures (and the kernels) as JSON here.")
flags.DEFINE_string(
  "from_json",
  "",
  "Print the report of an earlier --json_out again, with the current cost model (no compile).",
)


def _model_config():
  import dataclasses

  from jetrl.models import PRESETS, get_config
  from jetrl.models.io.hf_io import config_from_hf, resolve_path

  if FLAGS.model.lower() in PRESETS:
    cfg = get_config(FLAGS.model)
  else:
    try:
      path = Path(resolve_path(FLAGS.model))
    except ValueError as e:
      raise app.UsageError(
        f"--model={FLAGS.model!r} is neither a preset ({', '.join(PRESETS)}) nor a model "
        f"folder: {e}"
      ) from None
    if not (path / "config.json").is_file():
      raise app.UsageError(
        f"--model={FLAGS.model!r} is neither a preset ({', '.join(PRESETS)}) nor a folder "
        "with a config.json"
      )
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
  if FLAGS.layers is not None:
    if not 1 <= FLAGS.layers <= cfg.n_layers:
      raise app.UsageError(f"--layers={FLAGS.layers} must be in [1, {cfg.n_layers}]")
    cfg = dataclasses.replace(cfg, n_layers=FLAGS.layers)
  return cfg


def _kernel_settings() -> KernelConfig:
  """The `--kernels.*` flags as a KernelConfig; a bad value names its flag."""
  try:
    return config_from_flags(KERNEL_DEFAULTS, FLAGS).kernels
  except FlagError as e:
    raise app.UsageError(str(e)) from None


def _check_flags():
  from jetrl.precision import KV_CACHE_RECIPES, RECIPES

  if FLAGS.recipe not in RECIPES:
    raise app.UsageError(f"--recipe={FLAGS.recipe!r}: accepted recipes are {list(RECIPES)}")
  if FLAGS.kv_cache == "fp8" and FLAGS.recipe not in KV_CACHE_RECIPES:
    raise app.UsageError(
      f"--kv_cache=fp8 needs one of the recipes {list(KV_CACHE_RECIPES)}, got --recipe={FLAGS.recipe}"
    )
  bad = [p for p in FLAGS.programs if p not in ("rollout", "update", "sft")]
  if bad or not FLAGS.programs:
    raise app.UsageError(f"--programs={FLAGS.programs}: accepted are rollout, update, sft")
  for name in ("batch", "prompt_len", "new_tokens", "rows", "seq"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.lora_rank < 0:
    raise app.UsageError(f"--lora_rank must be >= 0, got {FLAGS.lora_rank}")
  if FLAGS.lora_rank and (FLAGS.mesh or FLAGS.target.startswith("8x")):
    raise app.UsageError("--lora_rank: a LoRA update compiles on one device (no --mesh)")
  if FLAGS.seq < 2:
    raise app.UsageError("--seq must be >= 2 (a prompt token and a completion token)")


def _reprint(path: str) -> int:
  """The report of a --json_out file, estimated with today's calibration."""
  from jetrl.aot import cost, report
  from jetrl.aot.compile import Compiled
  from jetrl.aot.targets import get_target

  try:
    d = json.loads(Path(path).read_text())
    compiled = [Compiled.from_json(c) for c in d["compiled"]]
  except (OSError, ValueError, KeyError) as e:
    raise app.UsageError(f"--from_json={path!r}: not a compile report JSON ({e})")
  target = get_target(d["target"])
  params, calib = cost.load_params()
  print(f"compile report (from {path}): {d['model']}, recipe {d['recipe']}, target {target.name}")
  text, rows = report.lines(compiled, target, params, calib, FLAGS.top)
  print("\n".join(text))
  _summaries(rows, target, d["params"], d["settings"]["new_tokens"])
  return 0


def _summaries(rows, target, n_params: int, new_tokens: int) -> None:
  """MFU of the update / SFT step and the rollout's time per generated token (estimates)."""
  for r in rows:
    if r["program"] in ("update", "sft") and r.get("tokens"):
      mfu = 6.0 * n_params * r["tokens"] / (r["est_ms"] / 1e3)
      mfu /= target.peak_bf16_tflops * 1e12 * target.devices
      r["est_mfu_6nd"] = mfu
      print(f"{r['program']}: est. MFU (6 N D over the bf16 peak) {100 * mfu:.1f}%")
  by = {r["program"]: r for r in rows}
  if "decode" in by:
    total_ms = sum(by[k]["est_ms"] for k in ("rollout_weights", "prefill", "decode") if k in by)
    print(
      f"rollout: est. {total_ms / new_tokens:.3f} ms per generated token "
      f"(the whole sample() call over {new_tokens} steps, as bench_device reports it)"
    )


def _say(line: str) -> None:
  print(line, flush=True)


def main(argv):
  del argv
  if FLAGS.from_json:
    return _reprint(FLAGS.from_json)
  _check_flags()
  kernels = _kernel_settings()
  for note in KERNEL_NOTES:
    print(f"note: {note}", flush=True)
  import jax.numpy as jnp
  import numpy as np

  from jetrl.aot import cost, programs, report
  from jetrl.aot.compile import compile_program
  from jetrl.aot.targets import MissingPlugin, compiling_for, devices, get_target, target_device
  from jetrl.train.progress import ticking
  from jetrl.models.lora import LoraConfig
  from jetrl.precision import get_recipe
  from jetrl.rl import UpdateConfig

  target = get_target(FLAGS.target)
  cfg = _model_config()
  recipe = get_recipe(FLAGS.recipe, kv_cache=FLAGS.kv_cache)
  try:
    devs = devices(target)
  except MissingPlugin as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  params, calib = cost.load_params()
  n_params = int(sum(np.prod(a.shape) for a in _leaves(programs.abstract_params(cfg, jnp.float32))))
  print(
    f"compile report: {FLAGS.model} ({cfg.n_layers} layers, {n_params / 1e9:.2f} B params), "
    f"recipe {FLAGS.recipe}{' (FP8 KV cache)' if FLAGS.kv_cache == 'fp8' else ''}, target {target.name} ({target.devices} x {target.device_kind}, "
    f"{target.hbm_gib:.0f} GiB, {target.hbm_gbps:.0f} GB/s, {target.peak_bf16_tflops:.0f} "
    f"bf16 TFLOP/s)",
    flush=True,
  )
  compiled, failures = [], []
  prompt_len, completion_len = FLAGS.seq // 2, FLAGS.seq - FLAGS.seq // 2
  device = target_device(target, kernels)  # what every program's plan is resolved for
  with compiling_for(target, kernels.cublaslt_graphs):
    progs = []
    if "rollout" in FLAGS.programs:
      if target.devices > 1:
        failures.append(("rollout", "the compile report compiles the sampler on one device"))
      else:
        progs += programs.rollout_programs(
          cfg,
          recipe,
          devs,
          device=device,
          batch=FLAGS.batch,
          prompt_len=FLAGS.prompt_len,
          new_tokens=FLAGS.new_tokens,
          param_dtype=jnp.dtype(FLAGS.param_dtype),
        )
    if "update" in FLAGS.programs:
      progs.append(
        programs.update_program(
          cfg,
          recipe,
          devs,
          device=device,
          rows=FLAGS.rows,
          prompt_len=prompt_len,
          completion_len=completion_len,
          mesh=FLAGS.mesh,
          update=UpdateConfig(
            master_dtype=FLAGS.master_dtype, old_logp=FLAGS.old_logp, remat=FLAGS.remat
          ),
          lora=LoraConfig(rank=FLAGS.lora_rank, alpha=FLAGS.lora_alpha),
        )
      )
    if "sft" in FLAGS.programs:
      progs.append(
        programs.sft_program(
          cfg,
          recipe,
          devs,
          device=device,
          rows=FLAGS.rows,
          prompt_len=prompt_len,
          completion_len=completion_len,
        )
      )
    for p in progs:
      try:
        with ticking(f"compiling {p.name} for {target.name}", _say):  # a clock while it runs
          compiled.append(compile_program(p, target))
      except Exception as e:  # pylint: disable=broad-except
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
        failures.append((p.name, msg))
        print(f"  {p.name} does not compile for {target.name}: {msg}", flush=True)
        continue
  print()
  text, rows = report.lines(compiled, target, params, calib, FLAGS.top)
  print("\n".join(text))
  _summaries(rows, target, n_params, FLAGS.new_tokens)
  for name, msg in failures:
    print(f"{name}: not compiled for {target.name}: {msg}")
  if FLAGS.json_out:
    out = dict(
      target=target.name,
      model=FLAGS.model,
      layers=cfg.n_layers,
      params=n_params,
      recipe=FLAGS.recipe,
      settings=dict(
        batch=FLAGS.batch,
        prompt_len=FLAGS.prompt_len,
        new_tokens=FLAGS.new_tokens,
        rows=FLAGS.rows,
        seq=FLAGS.seq,
        mesh=FLAGS.mesh,
        lora_rank=FLAGS.lora_rank,
        master_dtype=FLAGS.master_dtype,
        old_logp=FLAGS.old_logp,
        kv_cache=FLAGS.kv_cache,
        kernels=dataclasses.asdict(kernels),
      ),
      cost_params=params.as_dict(),
      programs=rows,
      failures=[dict(program=n, error=m) for n, m in failures],
      compiled=[c.to_json() for c in compiled],
      note="compiled-program figures; est_* are cost-model estimates",
    )
    Path(FLAGS.json_out).write_text(json.dumps(out, indent=1) + "\n")
  return 1 if failures and not compiled else 0


def _leaves(tree):
  import jax

  return jax.tree_util.tree_leaves(tree)


if __name__ == "__main__":
  app.run(main)
