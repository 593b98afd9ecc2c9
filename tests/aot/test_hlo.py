"""jetrl.aot.hlo and jetrl.aot.cost on a hand-written HLO module, against hand-computed
counts, bytes and FLOPs (no compiler involved)."""

from __future__ import annotations

import pytest

from jetrl.aot import cost, hlo, kernels
from jetrl.aot.targets import get_target

MODULE = """HloModule m, is_scheduled=true

%fused_dus (param_0: bf16[8,1024], param_1: bf16[8,1], param_2: s32[]) -> bf16[8,1024] {
  %param_0 = bf16[8,1024]{1,0} parameter(0)
  %param_1 = bf16[8,1]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = bf16[8,1024]{1,0} dynamic-update-slice(%param_0, %param_1, %constant_0, %param_2)
}

%fused_slice (param_0.1: f32[64,256]) -> f32[4,256] {
  %param_0.1 = f32[64,256]{1,0} parameter(0)
  %bitcast.9 = f32[64,256]{1,0} bitcast(%param_0.1)
  ROOT %slice.1 = f32[4,256]{1,0} slice(%bitcast.9), slice={[0:4], [0:256]}
}

%fused_dot (p0: bf16[32,64], p1: bf16[64,16]) -> f32[32,16] {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %p1 = bf16[64,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[32,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_lt (pc: s32[]) -> pred[] {
  %pc = s32[] parameter(0)
  %c5 = s32[] constant(5)
  ROOT %lt = pred[] compare(%pc, %c5), direction=LT
}

%fused_inc (pi: s32[]) -> s32[] {
  %pi = s32[] parameter(0)
  %c1 = s32[] constant(1)
  ROOT %add = s32[] add(%pi, %c1)
}

%cond (arg.1: (s32[], bf16[8,1024], bf16[16,32], bf16[32,8])) -> pred[] {
  %arg.1 = (s32[], bf16[8,1024]{1,0}, bf16[16,32]{1,0}, bf16[32,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %cmp = pred[] fusion(%i.1), kind=kLoop, calls=%fused_lt
}

%body (arg: (s32[], bf16[8,1024], bf16[16,32], bf16[32,8])) -> (s32[], bf16[8,1024], bf16[16,32], bf16[32,8]) {
  %arg = (s32[], bf16[8,1024]{1,0}, /*index=1*/bf16[16,32]{1,0}, bf16[32,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buf = bf16[8,1024]{1,0} get-tuple-element(%arg), index=1
  %a = bf16[16,32]{1,0} get-tuple-element(%arg), index=2
  %b = bf16[32,8]{1,0} get-tuple-element(%arg), index=3
  %gemm = (f32[16,8]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %upd = bf16[8,1]{1,0} constant({...})
  %dus = bf16[8,1024]{1,0} fusion(%buf, %upd, %i), kind=kLoop, calls=%fused_dus
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_inc
  ROOT %t = (s32[], bf16[8,1024]{1,0}, bf16[16,32]{1,0}, bf16[32,8]{1,0}) tuple(%next, %dus, %a, %b)
}

ENTRY %main (x: f32[64,256], y: bf16[32,64], z: bf16[64,16], w: (s32[], bf16[8,1024], bf16[16,32], bf16[32,8])) -> f32[4,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %y = bf16[32,64]{1,0} parameter(1)
  %z = bf16[64,16]{1,0} parameter(2)
  %w = (s32[], bf16[8,1024]{1,0}, bf16[16,32]{1,0}, bf16[32,8]{1,0}) parameter(3)
  %s = f32[4,256]{1,0} fusion(%x), kind=kLoop, calls=%fused_slice
  %d = f32[32,16]{1,0} fusion(%y, %z), kind=kLoop, calls=%fused_dot
  %cp = f32[4,256]{1,0} copy(%s)
  %ars = f32[4,256]{1,0} all-reduce-start(%cp), replica_groups={}, to_apply=%fused_inc
  %ard = f32[4,256]{1,0} all-reduce-done(%ars)
  %loop = (s32[], bf16[8,1024]{1,0}, bf16[16,32]{1,0}, bf16[32,8]{1,0}) while(%w), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[4,256]{1,0} bitcast(%ard)
}
"""


@pytest.fixture(scope="module")
def launches():
  return kernels.kernels(MODULE)


def by_name(launches):
  return {k.name: k for k in launches.kernels}


def test_only_launching_instructions_are_kernels(launches):
  # parameters, get-tuple-element, tuple, bitcast, constant and all-reduce-done launch nothing
  assert sorted(by_name(launches)) == ["ars", "cmp", "cp", "d", "dus", "gemm", "next", "s"]
  kinds = {k.name: k.kind for k in launches.kernels}
  assert kinds == dict(
    s="fusion",
    d="gemm_fusion",
    cp="copy",
    ars="collective",
    cmp="fusion",
    gemm="cublas",
    dus="fusion",
    next="fusion",
  )


def test_loop_counts(launches):
  k = by_name(launches)
  assert launches.iterations == 5
  assert (k["gemm"].count, k["dus"].count, k["next"].count) == (5, 5, 5)
  assert k["cmp"].count == 6  # the condition runs once more than the body
  assert k["s"].count == 1 and k["s"].loop is None
  assert k["gemm"].loop == "loop"
  assert sum(x.count for x in launches.kernels) == 4 + 5 * 3 + 6


def test_bytes_and_flops(launches):
  k = by_name(launches)
  # a slice of rows 0:4 of f32[64,256] reads 4 * 256 * 4 bytes, not the whole operand
  assert (k["s"].bytes_read, k["s"].bytes_written) == (4 * 256 * 4, 4 * 256 * 4)
  # the dot fusion reads both operands and writes f32[32,16]; 2 * M * N * K flops
  assert k["d"].bytes_read == 32 * 64 * 2 + 64 * 16 * 2
  assert k["d"].bytes_written == 32 * 16 * 4
  assert k["d"].flops == 2 * 32 * 16 * 64 and k["d"].gemm_dtype == "bf16"
  # cuBLAS: a [16,32] . b [32,8]; the s8 workspace is not traffic
  assert k["gemm"].flops == 2 * 16 * 8 * 32
  assert k["gemm"].bytes_written == 16 * 8 * 4
  assert k["gemm"].bytes_read == 16 * 32 * 2 + 32 * 8 * 2
  # in-place update of one bf16[8,1] column: the update and the s32 index move, not the buffer
  assert (k["dus"].bytes_read, k["dus"].bytes_written) == (8 * 2 + 4, 8 * 2)


def test_cost_model_by_hand(launches):
  target = get_target("h200")
  p = cost.CostParams(launch_us=2.0, iteration_us=7.0, bw_eff=0.5, gemm_eff_bf16=0.8)
  k = by_name(launches)
  # memory-bound: bytes / (4.8e12 * 0.5) + 2 us
  assert cost.kernel_seconds(k["s"], target, p) == pytest.approx(8192 / 2.4e12 + 2e-6)
  big = kernels.Kernel("g", "cublas", "c", 1e6, 1e6, 2e12, 1, "bf16")
  assert cost.kernel_seconds(big, target, p) == pytest.approx(2e12 / (989e12 * 0.8) + 2e-6)
  f32 = kernels.Kernel("g", "cublas", "c", 1e6, 1e6, 2e12, 1, "f32")  # TF32: half the bf16 peak
  assert cost.kernel_seconds(f32, target, p) == pytest.approx(2e12 / (494.5e12 * 0.8) + 2e-6)
  total = sum(cost.kernel_seconds(x, target, p) * x.count for x in launches.kernels)
  assert cost.program_seconds(launches, target, p) == pytest.approx(total + 5 * 7e-6)


def test_shapes_of_tuples_and_fp8():
  assert hlo.shapes("(f8e4m3fn[16,896]{1,0}, /*index=1*/u8[32]{0}, pred[])") == [
    ("f8e4m3fn", (16, 896)),
    ("u8", (32,)),
    ("pred", ()),
  ]
  assert hlo.nbytes("(f8e4m3fn[16,896]{1,0}, s32[2])") == 16 * 896 + 8
  with pytest.raises(ValueError, match="element type"):
    hlo.nbytes("q7[3]")


OCCUPANCY = """HloModule o, is_scheduled=true

ENTRY %main (x: bf16[64,1536], a: f8e4m3fn[64,1536], b: f8e4m3fn[2048,1536], sa: f32[12,64], sb: f32[16,12], c: f8e4m3fn[64,8960], d: f8e4m3fn[1536,8960], sc: f32[70,64], sd: f32[12,70]) -> bf16[64,1536] {
  %x = bf16[64,1536]{1,0} parameter(0)
  %a = f8e4m3fn[64,1536]{1,0} parameter(1)
  %b = f8e4m3fn[2048,1536]{1,0} parameter(2)
  %sa = f32[12,64]{1,0} parameter(3)
  %sb = f32[16,12]{1,0} parameter(4)
  %c = f8e4m3fn[64,8960]{1,0} parameter(5)
  %d = f8e4m3fn[1536,8960]{1,0} parameter(6)
  %sc = f32[70,64]{1,0} parameter(7)
  %sd = f32[12,70]{1,0} parameter(8)
  %norm = (bf16[64,1536]{1,0}, f8e4m3fn[64,1536]{1,0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 8 : i32, grid_y = 1 : i32, grid_z = 1 : i32, name = "decode_norm_quant"}
  %qkv = (bf16[64,2048]{1,0}, u8[1024]{0}) custom-call(%a, %b, %sa, %sb), custom_call_target="jetrl_fp8_blockwise_gemm"
  %down = (bf16[64,1536]{1,0}, u8[1024]{0}) custom-call(%c, %d, %sc, %sd), custom_call_target="jetrl_fp8_blockwise_gemm"
  ROOT %y = bf16[64,1536]{1,0} get-tuple-element(%norm), index=0
}
"""


def test_occupancy_of_a_grid_and_of_fp8_gemm_tiles():
  """A Pallas kernel of 8 programs uses 8 of an H200's 132 multiprocessors; cuBLASLt's FP8 GEMM
  runs 128 x 128 tiles (64 x 2048: 16 of them), split four ways where its contraction is long
  (8960 = 70 blocks); the model divides the kernel's work by that share (hand-computed)."""
  k = {x.name: x for x in kernels.kernels(OCCUPANCY).kernels}
  assert (k["norm"].programs, k["qkv"].programs, k["down"].programs) == (8, 16, 12 * 4)
  target = get_target("h200")
  p = cost.CostParams(bw_eff=0.5, gemm_eff_fp8=0.5)
  bytes_norm = 64 * 1536 * 2 * 2 + 64 * 1536
  assert cost.work_seconds(k["norm"], target, p) == pytest.approx(bytes_norm / 2.4e12 / (8 / 132))
  bytes_qkv = 64 * 1536 + 2048 * 1536 + (12 * 64 + 16 * 12) * 4 + 64 * 2048 * 2
  assert cost.work_seconds(k["qkv"], target, p) == pytest.approx(bytes_qkv / 2.4e12 / (16 / 132))
  assert cost.occupancy(k["down"], target) == pytest.approx(48 / 132)  # split-K: 4 x 12 tiles
  assert cost.occupancy(k["norm"], get_target("tpu-v5e")) == 1.0  # not modelled there
  # A GEMM takes at least gemm_floor_us on a GPU (its K loop's latency), however few its bytes.
  tiny = kernels.Kernel("t", "cublas", "c", 1e3, 1e3, 2e6, 1, "bf16")
  assert cost.work_seconds(tiny, target, p) == pytest.approx(p.gemm_floor_us * 1e-6)


TWICE = """HloModule t, is_scheduled=true

ENTRY %main (gu: bf16[512,768]) -> f8e4m3fn[512,384] {
  %gu = bf16[512,768]{1,0} parameter(0)
  %sw = (f8e4m3fn[512,384]{1,0}, f32[3,512]{1,0}) custom-call(%gu, %gu), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 4 : i32, grid_y = 3 : i32, grid_z = 1 : i32, name = "fp8_swiglu_gate_up"}
  ROOT %q = f8e4m3fn[512,384]{1,0} get-tuple-element(%sw), index=0
}
"""


def test_an_operand_passed_twice_is_read_once():
  """SwiGLU's kernel takes the fused gate / up output twice (each program reads a block of
  each half): its traffic is the array once plus what it writes (hand-computed)."""
  (k,) = [x for x in kernels.kernels(TWICE).kernels if x.name == "sw"]
  assert k.bytes_read == 512 * 768 * 2
  assert k.bytes_written == 512 * 384 + 3 * 512 * 4


def _attention_module(grid_y: int) -> str:
  return f"""HloModule a, is_scheduled=true

ENTRY %main (q: bf16[4,8,128], k: bf16[4,2,1024,128], v: bf16[4,2,1024,128]) -> bf16[4,8,128] {{
  %q = bf16[4,8,128]{{2,1,0}} parameter(0)
  %k = bf16[4,2,1024,128]{{3,2,1,0}} parameter(1)
  %v = bf16[4,2,1024,128]{{3,2,1,0}} parameter(2)
  ROOT %att = bf16[4,8,128]{{2,1,0}} custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", backend_config={{debug = false, grid_x = 4 : i32, grid_y = {grid_y} : i32, grid_z = 1 : i32, name = "decode_attention_512slots"}}
}}
"""


def test_decode_attention_reads_its_slots_once_per_program():
  """512 of 1024 slots of each cache, read once by a program per (row, kv head) and four times
  by a program per query head (8 query heads on 2 kv heads), by hand."""
  slots = 2 * 4 * 2 * 512 * 128 * 2  # k and v: B x Hkv x n x Dh bf16
  q = 4 * 8 * 128 * 2
  for grid_y, times in ((2, 1), (8, 4)):
    (k,) = kernels.kernels(_attention_module(grid_y)).kernels
    assert k.programs == 4 * grid_y
    assert k.bytes_read == q + slots * times
