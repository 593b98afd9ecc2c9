"""jetrl.kernel_profile: the kernel counts and times read from a trace, against hand-computed
values on a trace of a known shape, and on a real profiler trace of this CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest

from jetrl.kernel_profile import format_summary, profile_call, summarize


def ev(name, start, dur, **stats):
  return NS(name=name, start_ns=start, duration_ns=dur, stats=list(stats.items()))


def line(name, *events):
  return NS(name=name, events=list(events))


def test_device_streams_counted_ops_lines_and_host_ignored():
  profile = NS(
    planes=[
      NS(name="/host:CPU", lines=[line("python", ev("py", 0, 1000, hlo_op="x"))]),
      NS(
        name="/device:GPU:0",
        lines=[
          line("XLA Ops", ev("fusion.1", 0, 500)),  # an op's span, not a kernel
          line("Stream #1(Compute)", ev("a", 0, 10), ev("b", 20, 30), ev("a", 60, 10)),
          line("Stream #2(MemcpyD2D)", ev("c", 100, 20)),
        ],
      ),
    ]
  )
  s = summarize(profile, steps=2, top=2)
  assert s["source"] == "device" and s["kernels"] == 4 and s["kernels_per_step"] == 2
  assert s["distinct"] == 3
  assert s["busy_ms"] == pytest.approx(70e-6) and s["span_ms"] == pytest.approx(120e-6)
  assert s["busy_share"] == pytest.approx(70 / 120)
  assert s["mean_kernel_us"] == pytest.approx(70 / 4 / 1e3)
  assert [(k["name"], k["count"]) for k in s["top"]] == [("b", 1), ("a", 2)]
  assert s["top"][0]["share"] == pytest.approx(30 / 70)
  text = format_summary(s)
  assert text[0].startswith("profile (device): 4 kernels (2 a step, 3 distinct")
  assert "busy 0.0 of 0.0 ms (58%)" in text[0]


def test_without_a_device_the_host_xla_ops_count():
  profile = NS(
    planes=[
      NS(
        name="/host:CPU",
        lines=[
          line("python", ev("trace", 0, 900)),
          line("worker", ev("fusion", 10, 40, hlo_op="fusion"), ev("Record", 50, 0)),
        ],
      )
    ]
  )
  s = summarize(profile)
  assert s["source"] == "host" and s["kernels"] == 1 and s["top"][0]["name"] == "fusion"
  assert summarize(NS(planes=[]))["kernels"] == 0
  with pytest.raises(ValueError, match="steps must be >= 1"):
    summarize(profile, steps=0)


def test_a_real_trace_of_this_machine(tmp_path):
  f = jax.jit(lambda x: jnp.sin(x) @ x.T)
  x = jnp.ones((128, 128), jnp.float32)
  f(x).block_until_ready()
  s = profile_call(lambda: f(x), str(tmp_path), steps=1)
  assert os.path.exists(s["trace"]) and s["kernels"] >= 1
  assert s["source"] == ("device" if jax.default_backend() == "gpu" else "host")
  assert s["busy_share"] > 0  # above 1 where threads or streams overlap
