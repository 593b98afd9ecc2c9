"""The bound on compiled programs' memory mappings, against the process's own /proc count."""

import os

import jax
import jax.numpy as jnp
import pytest

from jetrl.kernels.code_memory import bound_code_mappings, map_limit, mappings

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")


def _maps():
  with open("/proc/self/maps") as f:
    return len(f.read().splitlines())


def test_the_count_is_the_process_mappings_and_the_cap_is_linux_s():
  assert abs(mappings() - _maps()) <= 2  # (reading a file may map or unmap a page or two)
  with open("/proc/sys/vm/max_map_count") as f:
    assert map_limit() == int(f.read())


def test_past_the_share_the_caches_are_cleared_and_the_mappings_released():
  fns = [jax.jit(lambda x, k=k: jnp.sin(x * k) + x.sum()) for k in range(60)]
  before = _maps()
  for f in fns:
    f(jnp.ones(8)).block_until_ready()
  held = _maps()
  assert held - before >= 2 * len(fns), (before, held)  # each program holds mappings

  assert not bound_code_mappings(limit=10 * held)  # well under: nothing happens
  assert all(f._cache_size() == 1 for f in fns)

  lines = []
  assert bound_code_mappings(0.5, limit=held, log=lines.append)  # held > half of `limit`
  assert all(f._cache_size() == 0 for f in fns)
  assert _maps() <= held - 2 * len(fns), (held, _maps())
  assert "memory mappings" in lines[0] and "vm.max_map_count" in lines[0], lines
  assert float(fns[3](jnp.ones(8))[0]) == pytest.approx(float(jnp.sin(3.0) + 8.0))  # recompiles


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_share_outside_0_1_is_refused(fraction):
  with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
    bound_code_mappings(fraction)
