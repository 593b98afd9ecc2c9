"""The memory mappings that compiled CPU programs hold, and a bound on them.

Every program XLA:CPU compiles keeps a few memory mappings for its code (about six) for as long
as JAX caches it, and Linux caps the mappings of a process (`vm.max_map_count`, 65530 by
default). A process that compiles thousands of programs (a test suite, a study that trains
dozens of runs one after another) reaches the cap; XLA then cannot load a new program's code
("Failed to materialize symbols: ... xla_jit_dylib"), and in JAX 0.10.2 the process dies while
raising that error. `bound_code_mappings` clears JAX's caches once the process has used a
share of the cap: later calls recompile what they need, and no value changes.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax

MAPS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
DEFAULT_MAX_MAP_COUNT = 65530


def mappings() -> Optional[int]:
  """The process's memory mappings now (None where /proc is not there: not Linux)."""
  try:
    with open(MAPS, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def map_limit() -> int:
  """Linux's cap on a process's memory mappings (its default where it cannot be read)."""
  try:
    with open(MAX_MAP_COUNT) as f:
      return int(f.read())
  except (OSError, ValueError):
    return DEFAULT_MAX_MAP_COUNT


def bound_code_mappings(
  fraction: float = 0.5, *, limit: Optional[int] = None, log: Optional[Callable] = None
) -> bool:
  """Clears JAX's caches (compiled programs and traces) when this process holds more than
  `fraction` of `limit` (default: `map_limit()`) mappings; returns whether it did."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
  now = mappings()
  cap = map_limit() if limit is None else limit
  if now is None or now <= fraction * cap:
    return False
  jax.clear_caches()
  if log is not None:
    log(
      f"cleared JAX's compiled-program caches: this process held {now} memory mappings, over "
      f"{fraction:.0%} of the cap of {cap} (vm.max_map_count); what runs next recompiles"
    )
  return True
