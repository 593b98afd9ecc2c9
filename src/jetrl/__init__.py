"""jetrl: RL for LLM reasoning with one unified FP8 precision flow (Jet-RL) in JAX."""

import os as _os

# bf16 between operators must mean bf16: by default XLA may keep excess precision (skip a
# bf16 rounding) inside fusions, and it fuses the sampler's and the trainer's programs
# differently, so the same values could reach the FP8 quantizer rounded in one and not the
# other. Turned off unless the user set the flag; it takes effect if no JAX computation ran
# before jetrl was imported (see docs/numerics.md).
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
  _os.environ["XLA_FLAGS"] = (
    _os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
  ).strip()

__version__ = "0.1.0"
