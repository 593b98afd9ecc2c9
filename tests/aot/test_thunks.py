"""jetrl.aot.thunks on a hand-written thunk sequence in XLA's dump format, and the cost
model's launch term over it, against counts and seconds worked out by hand."""

from __future__ import annotations

import pytest

from jetrl.aot import cost, kernels, thunks

SEQUENCE = """000: kCommandBuffer [source       | next=003 (1)]
    001: kCopy         [source       | sink        ] kCopy
    002: kCustomKernel [source       | sink        ] loop_broadcast_fusion grid: [1, 1, 1]
003: kWhile         [prev=000 (1) | next=020 (1)]
condition:
    004: kCustomKernel [source       | next=005 (1)] input_reduce_fusion grid: [1, 1, 1]
    005: kCustomKernel [prev=004 (1) | sink        ] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer  [source       | next=010 (1)]
        006: kCustomKernel [source       | sink        ] input_reduce_fusion_2 grid: [8, 1, 1]
        007: kCustomKernel [source       | sink        ] loop_pad_fusion grid: [7, 1, 1]
        008: kCopy         [source       | sink        ] kCopy
    010: kCustomCall     [prev=000 (1) | next=011 (1)] kCustomCall
    011: kCublasLtMatmul [prev=010 (1) | next=012 (1)] kCublasLtMatmul
    012: kCustomKernel   [prev=011 (1) | sink        ] fusion_12 grid: [64, 1, 1]
020: kCustomKernel  [prev=003 (1) | sink        ] wrapped_add grid: [1, 1, 1]
021: kWhile         [prev=020 (1) | next=030 (1)]
condition:
    022: kCustomKernel [source       | sink        ] loop_compare_fusion grid: [1, 1, 1]
  body:
    023: kCustomCall     [source       | sink        ] kCustomCall
030: kCustomKernel  [prev=021 (1) | sink        ] loop_select_fusion grid: [1, 1, 1]
"""


def test_launch_counts_by_hand():
  t = thunks.launch_counts(SEQUENCE, [4, 3])
  # outside any loop: one command buffer (2 kernels inside) and 2 kernels alone
  # first loop, 4 trips: its condition (2 kernels alone) runs 5 times; the body launches one
  #   command buffer (3 kernels inside) and 3 thunks alone per trip
  # second loop, 3 trips: condition 1 kernel x 4, body 1 custom call x 3
  assert t.graphs == 1 + 4
  assert t.in_graph == 2 + 4 * 3
  assert t.alone == 2 + 5 * 2 + 4 * 3 + 4 * 1 + 3 * 1


def test_program_seconds_with_thunks_by_hand():
  from jetrl.aot.targets import get_target

  k = kernels.Kernel("k", "fusion", "c", 4.8e6, 0.0, 0.0, 10)  # 1 us of HBM at 4.8 TB/s, x10
  p = cost.CostParams(launch_us=2.0, graph_us=5.0, in_graph_us=0.5, iteration_us=3.0, bw_eff=1.0)
  counts = thunks.launch_counts(SEQUENCE, [4, 3])
  launches = kernels.Launches([k], iterations=7, thunks=counts.__dict__)
  want = 10 * 1e-6 + (counts.alone * 2.0 + counts.graphs * 5.0 + counts.in_graph * 0.5) * 1e-6
  want += 7 * 3e-6
  assert cost.program_seconds(launches, get_target("h200"), p) == pytest.approx(want)
  # without a thunk sequence every kernel launches on its own
  bare = kernels.Launches([k], iterations=7)
  assert cost.program_seconds(bare, get_target("h200"), p) == pytest.approx(
    10e-6 + 10 * 2e-6 + 21e-6
  )
