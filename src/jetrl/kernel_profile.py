"""Where a computation's device time goes: its kernels, counted and timed from a profiler trace.

  summary = profile_call(lambda: sample(...).tokens, "/tmp/prof", steps=256)

runs the call once under `jax.profiler.trace` (the trace stays in the directory, for
TensorBoard / XProf) and reads it back (`jax.profiler.ProfileData`): on a GPU the kernels of
the device's streams, elsewhere the XLA ops the host threads ran. The summary says how many
kernels ran (and how many per `steps`, e.g. per decode step), the time they kept the device
busy against the span from the first to the last (a device that is busy a small share of the
span waits on launches or the host; the share exceeds 1 where streams or threads overlap), and
the kernels that took most of the time.
"""

from __future__ import annotations

import collections
import glob
import os
from typing import Any, Callable, Iterable, Optional


def _stat(event, key: str):
  for k, v in getattr(event, "stats", ()) or ():
    if k == key:
      return v
  return None


def _kernel_events(profile) -> tuple[str, list]:
  """("device", the events of the device planes' stream lines) when the trace has a device,
  else ("host", the host events that name an XLA op)."""
  events = []
  for plane in profile.planes:
    if plane.name.startswith("/device:"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          events += list(line.events)
  if events:
    return "device", events
  for plane in profile.planes:
    if plane.name.startswith("/host:"):
      for line in plane.lines:
        events += [e for e in line.events if _stat(e, "hlo_op") is not None]
  return "host", events


def summarize(profile, steps: int = 1, top: int = 10) -> dict:
  """The kernels of a `jax.profiler.ProfileData` (or anything with the same planes / lines /
  events shape): count, per step, busy time, span, and the `top` kernels by total time."""
  if steps < 1:
    raise ValueError(f"summarize: steps must be >= 1, got {steps}")
  source, events = _kernel_events(profile)
  if not events:
    return dict(source=source, kernels=0, note="no kernel events in the trace")
  total: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  for e in events:
    total[e.name] += e.duration_ns
    count[e.name] += 1
  busy = sum(total.values())
  start = min(e.start_ns for e in events)
  end = max(e.start_ns + e.duration_ns for e in events)
  ranked = sorted(total, key=lambda n: -total[n])[:top]
  return dict(
    source=source,
    kernels=len(events),
    kernels_per_step=len(events) / steps,
    distinct=len(total),
    busy_ms=busy / 1e6,
    span_ms=(end - start) / 1e6,
    busy_share=busy / max(end - start, 1),
    mean_kernel_us=busy / len(events) / 1e3,
    top=[
      dict(name=n[:120], count=count[n], total_ms=total[n] / 1e6, share=total[n] / busy)
      for n in ranked
    ],
  )


def profile_call(fn: Callable[[], Any], directory: str, *, steps: int = 1, top: int = 10) -> dict:
  """`fn()` once (its result awaited) under the profiler, its trace written below
  `directory`, then `summarize`d; the summary's "trace" is the trace file's path."""
  import jax  # pylint: disable=import-outside-toplevel

  os.makedirs(directory, exist_ok=True)
  before = set(_traces(directory))
  with jax.profiler.trace(directory):
    jax.block_until_ready(fn())
  new = sorted(set(_traces(directory)) - before)
  if not new:
    return dict(kernels=0, note=f"the profiler wrote no trace under {directory}")
  summary = summarize(jax.profiler.ProfileData.from_file(new[-1]), steps=steps, top=top)
  summary["trace"] = new[-1]
  return summary


def _traces(directory: str) -> Iterable[str]:
  return glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)


def format_summary(s: dict, lines: Optional[int] = 5) -> list[str]:
  """A few console lines of a summary."""
  if not s.get("kernels"):
    return [f"profile: {s.get('note', 'no kernels')}"]
  out = [
    f"profile ({s['source']}): {s['kernels']} kernels ({s['kernels_per_step']:.0f} a step, "
    f"{s['distinct']} distinct, mean {s['mean_kernel_us']:.1f} us), busy {s['busy_ms']:.1f} of "
    f"{s['span_ms']:.1f} ms ({100 * s['busy_share']:.0f}%)"
  ]
  for k in s["top"][:lines]:
    out.append(
      f"  {100 * k['share']:5.1f}%  {k['total_ms']:8.2f} ms  x{k['count']:<6} {k['name'][:80]}"
    )
  return out
