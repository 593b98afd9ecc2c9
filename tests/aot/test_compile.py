"""Compiling for an H200 and a TPU v5e on this CPU machine (jetrl.aot): the kernels, bytes,
FLOPs and memory plans of known small programs against hand-computed values, FP8 GEMMs present
as the kernels a GPU runs, and the compile report's command."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jetrl.aot import programs
from jetrl.aot.compile import compile_program
from jetrl.aot.programs import Program, one_device_sharding
from jetrl.aot.targets import compiling_for, devices, get_target, target_device


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


HAVE_CUDA = _installed("jax_plugins.xla_cuda12")
HAVE_TPU = _installed("libtpu")
need_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="the aot extra (CUDA plugin) is missing")
need_tpu = pytest.mark.skipif(not HAVE_TPU, reason="the aot extra (libtpu) is missing")

M, K, N = 512, 256, 384


def _gemm(target_name):
  target = get_target(target_name)
  devs = devices(target)
  rep = one_device_sharding(devs)
  a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rep)
  b = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=rep)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16))
  with compiling_for(target):
    return compile_program(Program("gemm", f, (a, b), {}), target)


@need_cuda
def test_h200_gemm_is_one_kernel_with_its_bytes_and_flops():
  c = _gemm("h200")
  gemms = [k for k in c.launches.kernels if k.flops]
  assert len(c.launches.kernels) == 1 and len(gemms) == 1
  (k,) = gemms
  assert k.kind in ("cublas", "gemm_fusion") and k.count == 1
  assert k.flops == 2 * M * N * K
  assert k.bytes_read == (M * K + K * N) * 2 and k.bytes_written == M * N * 2
  assert c.memory["argument"] == (M * K + K * N) * 2
  assert c.memory["output"] == M * N * 2


@need_tpu
def test_tpu_v5e_gemm_flops():
  c = _gemm("tpu-v5e")
  assert sum(k.flops * k.count for k in c.launches.kernels) == 2 * M * N * K
  assert c.memory["argument"] == (M * K + K * N) * 2


@need_cuda
def test_jet_linear_compiles_to_the_cublaslt_ffi_gemm_on_fp8_operands():
  from jetrl.kernels import linear
  from jetrl.precision import get_recipe

  target = get_target("h200")
  rep = one_device_sharding(devices(target))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=rep)
  w = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=rep)
  from jetrl.kernels import resolve_plan

  jet = get_recipe("jet")
  plan = resolve_plan(jet.rollout, target_device(target))
  f = jax.jit(lambda a, b: linear(a, b, jet.rollout, plan))
  with compiling_for(target):
    c = compile_program(Program("linear", f, (x, w), {}), target, keep_text=True)
    # A function given no plan traces for this machine even here: nothing global says the
    # target (the plan's device does), so no FFI call.
    here = jax.jit(lambda a, b: linear(a, b, jet.rollout))
    text = here.trace(jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 384), jnp.bfloat16))
    assert "jetrl_fp8_blockwise_gemm" not in text.lower().as_text()
  ffi = [k for k in c.launches.kernels if k.kind == "jetrl_fp8_ffi"]
  assert len(ffi) == 1 and ffi[0].fp8 and ffi[0].flops == 2 * 256 * 384 * 512
  assert "f8e4m3fn[256,512]" in c.hlo_text  # the activations reach the GEMM as FP8


@need_cuda
@pytest.mark.parametrize(
  "backend,fused_quant,kinds",
  [
    ("pallas", False, {"pallas"}),  # the Pallas GEMM, lowered for Triton at compile time
    ("cublaslt", True, {"pallas", "jetrl_fp8_ffi"}),  # the one-pass quantization kernel + FFI
  ],
)
def test_pallas_kernels_compile_as_their_custom_calls(backend, fused_quant, kinds):
  from jetrl.kernels import KernelConfig, linear, resolve_plan
  from jetrl.precision import get_recipe, with_gemm_backend

  target = get_target("h200")
  rep = one_device_sharding(devices(target))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=rep)
  w = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=rep)
  rec = with_gemm_backend(get_recipe("jet"), backend)
  dev = target_device(target, KernelConfig(fused_quant=fused_quant))
  f = jax.jit(lambda a, b: linear(a, b, rec.rollout, resolve_plan(rec.rollout, dev)))
  with compiling_for(target):
    c = compile_program(Program("linear", f, (x, w), {}), target)
  assert kinds <= {k.kind for k in c.launches.kernels}
  assert not any(k.kind == "cublas" for k in c.launches.kernels)  # no dequantized float dot


@need_cuda
def test_update_memory_plan_holds_params_and_adam_state():
  from jetrl.models import get_config
  from jetrl.precision import get_recipe

  cfg = dataclasses.replace(get_config("tiny"), n_layers=1, max_seq_len=64)
  target = get_target("h200")
  devs = devices(target)
  n = sum(a.size for a in jax.tree_util.tree_leaves(programs.abstract_params(cfg, jnp.float32)))
  with compiling_for(target):
    p = programs.update_program(
      cfg,
      get_recipe("bf16"),
      devs,
      device=target_device(target),
      rows=2,
      prompt_len=8,
      completion_len=8,
    )
    c = compile_program(p, target)
  # float32 params plus AdamW's two moments, all arguments of the step (donated: aliased)
  assert c.memory["argument"] >= 3 * 4 * n
  assert c.peak_bytes > 3 * 4 * n
  assert c.memory["alias"] >= 3 * 4 * n
  assert sum(k.flops * k.count for k in c.launches.kernels) > 0


@need_cuda
def test_lora_update_holds_a_float8_base_and_adapter_state_only():
  from jetrl.models import get_config
  from jetrl.models.lora import LoraConfig
  from jetrl.precision import get_recipe

  cfg = dataclasses.replace(get_config("tiny"), n_layers=1, max_seq_len=64)
  target = get_target("h200")
  devs = devices(target)
  shapes = programs.abstract_params(cfg, jnp.float32)
  n = sum(a.size for a in jax.tree_util.tree_leaves(shapes))
  n_proj = sum(
    shapes["layers"][w].size for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  )
  with compiling_for(target):
    p = programs.update_program(
      cfg,
      get_recipe("jet"),
      devs,
      device=target_device(target),
      rows=2,
      prompt_len=8,
      completion_len=8,
      lora=LoraConfig(rank=8),
    )
    c = compile_program(p, target)
  f8 = [a for a in jax.tree_util.tree_leaves(p.args[0].frozen) if a.dtype == jnp.float8_e4m3fn]
  assert sum(a.size for a in f8) == n_proj  # every projection of the base, one byte a weight
  # The base's projections in FP8 and the rest in float32, with no AdamW moments for any of it:
  # far below full fine-tuning's float32 params plus two moments (12 bytes a param).
  assert 1 * n_proj + 4 * (n - n_proj) <= c.memory["argument"] < 6 * n


def _report(tmp_path, *flags, env=None):
  out = tmp_path / "report.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
  r = subprocess.run(
    [sys.executable, "experiments/compile_report.py", *flags, f"--json_out={out}"],
    capture_output=True,
    text=True,
    env=env,
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    timeout=600,
  )
  return r, (json.loads(out.read_text()) if out.exists() else None)


SMALL = ("--model=tiny", "--layers=1", "--batch=2", "--prompt_len=8", "--new_tokens=4")
SMALL += ("--rows=2", "--seq=16")


@need_cuda
def test_compile_report_command_h200(tmp_path):
  r, data = _report(
    tmp_path, "--target=h200", "--recipe=jet", "--programs=rollout,update,sft", *SMALL
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert "ESTIMATES" in r.stdout and "per decode step" in r.stdout
  progs = {p["program"]: p for p in data["programs"]}
  assert set(progs) == {"rollout_weights", "prefill", "decode", "update", "sft"}
  step = progs["decode"]["decode_step"]
  # one layer: the FP8 projections (fused q/k/v, o, fused gate/up, down) on cuBLASLt
  assert step["by_kind"].get("jetrl_fp8_ffi") == 4
  assert progs["decode"]["kernels"] >= 4 * step["kernels"]  # 4 steps of the loop
  assert all(p["fits"] for p in progs.values())


@need_tpu
def test_compile_report_command_tpu7x(tmp_path):
  r, data = _report(tmp_path, "--target=tpu7x", "--recipe=bf16", "--programs=rollout", *SMALL)
  assert r.returncode == 0, r.stderr[-2000:]
  assert {p["program"] for p in data["programs"]} == {"rollout_weights", "prefill", "decode"}


def test_compile_report_rejects_a_bad_recipe(tmp_path):
  r, _ = _report(tmp_path, "--target=h200", "--recipe=fp7", *SMALL)
  assert r.returncode != 0
  assert "--recipe='fp7'" in r.stderr and "accepted recipes" in r.stderr


@need_cuda
def test_compile_report_reads_a_hugging_face_folder(tmp_path):
  from jetrl.models import get_config, init_params, save_pretrained

  cfg = dataclasses.replace(get_config("tiny"), n_layers=2, max_seq_len=64)
  folder = tmp_path / "model"
  save_pretrained(init_params(cfg, jax.random.PRNGKey(0)), cfg, str(folder))
  flags = (f"--model={folder}", "--rows=2", "--seq=16", "--programs=update")
  r, data = _report(tmp_path, "--target=h200", "--recipe=bf16", *flags)
  assert r.returncode == 0, r.stderr[-2000:]
  assert data["layers"] == 2
  n = sum(a.size for a in jax.tree_util.tree_leaves(programs.abstract_params(cfg, jnp.float32)))
  assert data["params"] == n
  r, _ = _report(tmp_path, "--target=h200", "--model=/nonexistent/folder", "--programs=update")
  assert r.returncode != 0 and "neither a preset" in r.stderr


@need_cuda
def test_flash_attention_compiles_with_its_matmuls_counted():
  """A training forward's attention compiled for an H200 is JAX's Pallas flash kernels, no
  dense [T, T] dots; their FLOPs come from q's shape (causal: half the tiles)."""
  from jetrl.kernels import attention as attn

  target = get_target("h200")
  rep = one_device_sharding(devices(target))
  b, t, h, hkv, d = 2, 256, 4, 2, 64
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=rep)
  kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16, sharding=rep)

  dev = target_device(target)

  def loss(q, k, v):
    assert attn.use_flash(None, t, d, jnp.bfloat16, dev)
    return jnp.sum(attn.attend_flash(q, k, v, None, jnp.bfloat16, dev=dev).astype(jnp.float32))

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  with compiling_for(target):
    c = compile_program(Program("flash", f, (q, kv, kv), {}), target)
  pallas = [k for k in c.launches.kernels if k.kind == "pallas" and k.flops]
  per = 2.0 * b * h * t * t * d * 0.5  # one causal [T, D] x [D, T] matmul, 2 FLOPs a MAC
  assert sorted(k.flops / per for k in pallas) == [2.0, 7.0]  # forward, backward
  assert not any(k.kind == "cublas" for k in c.launches.kernels)


@need_cuda
def test_a_decode_step_linear_and_attention_compile_without_extra_kernels():
  """At decode sizes on an H200: jet's linear is one quantization kernel and the FP8 GEMM
  (XLA took three kernels to quantize), and one query's attention has no cuBLAS call."""
  from jetrl.kernels import attention as attn
  from jetrl.kernels import linear
  from jetrl.precision import get_recipe

  target = get_target("h200")
  rep = one_device_sharding(devices(target))
  x = jax.ShapeDtypeStruct((64, 1536), jnp.bfloat16, sharding=rep)
  w = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16, sharding=rep)
  from jetrl.kernels import resolve_plan

  rollout = get_recipe("jet").rollout
  dev = target_device(target)
  plan = resolve_plan(rollout, dev)
  with compiling_for(target):
    c = compile_program(
      Program("linear", jax.jit(lambda a, b: linear(a, b, rollout, plan)), (x, w), {}), target
    )
  kinds = sorted(k.kind for k in c.launches.kernels)
  # The weight's own quantization (once per rollout in the sampler) is in this program too.
  assert kinds.count("pallas") == 1 and kinds.count("jetrl_fp8_ffi") == 1
  q = jax.ShapeDtypeStruct((64, 1, 12, 128), jnp.bfloat16, sharding=rep)
  kv = jax.ShapeDtypeStruct((64, 2, 512, 128), jnp.bfloat16, sharding=rep)
  allowed = jax.ShapeDtypeStruct((64, 1, 512), jnp.bool_, sharding=rep)
  f = jax.jit(lambda q, k, v, a: attn.attend(q, k, v, a, jnp.bfloat16, dev=dev))
  with compiling_for(target):
    c = compile_program(Program("attend", f, (q, kv, kv, allowed), {}), target)
  assert not any(k.kind == "cublas" for k in c.launches.kernels)
  assert len(c.launches.kernels) <= 4


@need_cuda
def test_a_decode_step_is_eight_kernels_a_layer_under_bf16_and_jet(tmp_path):
  """qwen2.5-1.5b's shapes, 64 rows, two layers: under jet every projection's input comes
  quantized from the kernel before it (models/decode_fused.py), so jet's step has bf16's
  kernel count; a layer is the four GEMMs, two norms, the fused attention block and SwiGLU."""
  steps = {}
  for recipe in ("bf16", "jet"):
    flags = ("--target=h200", "--model=qwen2.5-1.5b", "--layers=2", f"--recipe={recipe}")
    r, data = _report(tmp_path, *flags, "--programs=rollout")
    assert r.returncode == 0, r.stderr[-2000:]
    steps[recipe] = next(p for p in data["programs"] if p["program"] == "decode")["decode_step"]
  bf16, jet = steps["bf16"]["by_kind"], steps["jet"]["by_kind"]
  assert steps["jet"]["kernels"] == steps["bf16"]["kernels"]
  assert bf16["cublas"] == 2 * 4 + 1 and bf16["pallas"] == 2  # + the LM head; attention
  assert jet["jetrl_fp8_ffi"] == 2 * 4 and jet["pallas"] == 2 * 4  # + 2 norms and SwiGLU
  assert steps["jet"]["mb"] < steps["bf16"]["mb"]  # FP8 weights (the bf16 LM head dominates)


@need_cuda
def test_swiglu_kernels_take_the_mlp_quantization_out_of_the_jet_update(tmp_path):
  """qwen2.5-1.5b's shapes, one layer, 2 x 256 tokens: with SwiGLU's FP8 kernels
  (jetrl.kernels.mlp, on by default) jet's update runs fewer kernels and moves fewer bytes
  than with the MLP unfused (JETRL_FUSED_MLP=0): the five quantizations of the backward's
  widest arrays and the forward's h are written by the two kernels."""
  flags = ("--target=h200", "--model=qwen2.5-1.5b", "--layers=1", "--recipe=jet")
  flags += ("--programs=update", "--rows=2", "--seq=257")
  runs = {}
  for fused in ("1", "0"):
    r, data = _report(tmp_path, *flags, env={"JETRL_FUSED_MLP": fused})
    assert r.returncode == 0, r.stderr[-2000:]
    runs[fused] = next(p for p in data["programs"] if p["program"] == "update")
  on, off = runs["1"], runs["0"]
  assert on["kernels"] <= off["kernels"] - 5, (on["kernels"], off["kernels"])
  mb = lambda p: p["read_gb"] + p["written_gb"]
  assert mb(on) < mb(off) and on["est_ms"] < off["est_ms"]


@need_cuda
def test_compile_linear_command():
  """experiments/compile_linear.py: at a decode step's 64 rows, jet's GEMM from a given
  QuantizedInput is one kernel, as bf16's, and moves about half of bf16's bytes."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  cmd = [sys.executable, "experiments/compile_linear.py", "--m=64"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [
    line.split("|") for line in r.stdout.splitlines() if line.startswith("| ") and "x" in line
  ]
  rows = [row for row in rows if row[1].strip() in ("qkv", "o", "gate_up", "down")]
  assert [row[1].strip() for row in rows] == ["qkv", "o", "gate_up", "down"]
  for row in rows:
    assert row[3].strip().startswith("1 /") and row[5].strip().startswith("1 /")
    assert float(row[8]) <= 0.55
  bad = subprocess.run(cmd[:2] + ["--m=0"], capture_output=True, text=True, env=env, cwd=root)
  assert bad.returncode != 0 and "--m: row counts of at least 1" in bad.stderr


@need_cuda
def test_the_decode_gemm_compiles_as_one_kernel_of_enough_programs():
  """KernelConfig(decode_gemm="pallas"): a decode step's FP8 GEMM from a QuantizedInput compiles for an
  H200 as one Pallas kernel of N / 16 programs for a 2048-wide projection (128, where
  cuBLASLt's 128 x 128 tiles run 16), reading FP8 operands, its FLOPs counted."""
  from jetrl.kernels import KernelConfig, linear, resolve_plan
  from jetrl.precision import QuantizedInput, get_recipe, prequantize_weight

  target = get_target("h200")
  rep = one_device_sharding(devices(target))
  rollout = get_recipe("jet").rollout
  xq = jax.ShapeDtypeStruct((64, 1536), jnp.float8_e4m3fn, sharding=rep)
  xs = jax.ShapeDtypeStruct((12, 64), jnp.float32, sharding=rep)
  w = jnp.zeros((1536, 2048), jnp.float32)
  with compiling_for(target):
    plan = resolve_plan(rollout, target_device(target, KernelConfig(decode_gemm="pallas")))
    wq = plan.with_gemm_scales(prequantize_weight(w, rollout.fprop, k_major=True), rollout.fprop)
    spec = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), wq
    )
    f = jax.jit(lambda q, s, w_: linear(QuantizedInput(q, s), w_, rollout, plan))
    c = compile_program(Program("decode_gemm", f, (xq, xs, spec), {}), target)
  (k,) = [k for k in c.launches.kernels if k.kind == "pallas"]
  assert k.programs == 2048 // 16
  assert not any(x.kind == "jetrl_fp8_ffi" for x in c.launches.kernels)
  assert k.bytes_read >= 1536 * 2048  # the FP8 weight, a byte a value
  assert k.flops == 2 * 64 * 2048 * 1536 and k.gemm_dtype == "f8"
