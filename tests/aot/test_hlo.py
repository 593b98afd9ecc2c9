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
