"""Device meshes, partition rules, sharded steps and several processes (jax.jit + NamedSharding
SPMD)."""

from jetrl.parallel.hosts import (
  all_true,
  barrier,
  gather_rows,
  is_primary,
  maybe_initialize_distributed,
  multi_process_env,
  on_primary,
  owned_rows,
  primary_log,
  rows_to_host,
)
from jetrl.parallel.mesh import (
  AXES,
  DATA,
  FSDP,
  TENSOR,
  make_mesh,
  mesh_str,
  parse_mesh,
  resolve_mesh_shape,
)
from jetrl.parallel.rules import (
  MODES,
  Layout,
  TokenSplit,
  check_fp8_alignment,
  fp8_blocks,
  make_layout,
  param_specs,
  put,
)
from jetrl.parallel.steps import sharded_update_step, switch_layout, to_host

__all__ = [
  "AXES",
  "DATA",
  "FSDP",
  "TENSOR",
  "MODES",
  "Layout",
  "TokenSplit",
  "make_mesh",
  "make_layout",
  "parse_mesh",
  "resolve_mesh_shape",
  "mesh_str",
  "param_specs",
  "check_fp8_alignment",
  "fp8_blocks",
  "put",
  "sharded_update_step",
  "switch_layout",
  "to_host",
  "maybe_initialize_distributed",
  "multi_process_env",
  "is_primary",
  "barrier",
  "all_true",
  "on_primary",
  "primary_log",
  "owned_rows",
  "rows_to_host",
  "gather_rows",
]
