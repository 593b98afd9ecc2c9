"""Compile-only programs for accelerators this machine lacks (docs/compile_report.md).

`tracing_for(target)`: trace and compile jetrl's programs for a compile-report target (an H200,
a TPU) from code outside the project (`jetrl.aot.tracing`).
"""

from jetrl.aot.tracing import Tracing, tracing_for

__all__ = ["Tracing", "tracing_for"]
