"""Row ownership, gathering and agreement across 2 processes x 2 CPU devices; started by
test_multi_process.py through `python -m jetrl.launch --processes=2 --local_devices=2`.

Prints `ok <name>` for each check that passed; any failure raises (a non-zero exit)."""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jetrl import parallel
from jetrl.config import FlagError

parallel.maybe_initialize_distributed(log=lambda *_: None)
assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
me = jax.process_index()
mesh = parallel.make_mesh("data:2,fsdp:2")
values = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) * 1.5 - 7

# Rows over data x fsdp: process 0 holds rows 0-3, process 1 rows 4-7.
sharded = parallel.put(values, NamedSharding(mesh, P(("data", "fsdp"))))
rows = parallel.owned_rows(sharded)
assert rows.tolist() == list(range(4 * me, 4 * me + 4)), rows
local = parallel.rows_to_host(sharded, rows)
np.testing.assert_array_equal(local, values[rows])
np.testing.assert_array_equal(parallel.gather_rows(local[:, 0] * 2, rows, 8), values[:, 0] * 2)
print("ok sharded rows", flush=True)

# Rows over fsdp only (replicated over data, which spans the processes here: devices of both
# processes hold every row): each row is owned once, by the lowest process.
half = parallel.put(values, NamedSharding(mesh, P("fsdp")))
rows = parallel.owned_rows(half)
assert rows.tolist() == (list(range(8)) if me == 0 else []), (me, rows)
got = parallel.gather_rows(parallel.rows_to_host(half, rows), rows, 8)
np.testing.assert_array_equal(got, values)
print("ok replicated rows", flush=True)

# Agreement: all_true, and an error made on the primary only is raised everywhere.
assert parallel.all_true(True) and not parallel.all_true(me == 0)


def refuse():
  raise FlagError("workdir", "refused on the primary")


try:
  parallel.on_primary(refuse)
except FlagError as e:
  assert str(e) == "--workdir: refused on the primary", str(e)
else:
  sys.exit("on_primary did not raise")
assert parallel.on_primary(lambda: "x") == ("x" if me == 0 else None)
parallel.barrier("hosts-cases-end")
print("ok agreement", flush=True)
