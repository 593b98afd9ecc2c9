"""The kernels' own partitioning on a device mesh: a custom call sharded as its operands are.

XLA cannot look inside a custom call (the cuBLASLt FP8 GEMM, a Pallas kernel), so on a mesh it
gathers the call's operands onto every device and runs the whole call on each: under FSDP every
device would compute the whole batch's GEMMs. `sharded(fn, rule)` wraps a kernel in
`jax.experimental.custom_partitioning` with a rule that says how each of its operands' axes
relate, so that each device runs the kernel on its own shard:

  rule "p c, cb p, q c, qb cb -> p q"  (the blockwise GEMM: a, a's scales, b, b's scales)

Each letter group names an axis (a factor). A factor written in `ties` follows another one's
sharding (a scale's block axis follows the axis it scales: cb -> c), and a sharded axis must
split into whole blocks of `block[factor]` elements per device (a 1 x 128 group never straddles
two devices); an axis that would not is gathered. Factors missing from the result are summed
(`reduce`): each device's partial result is summed over the axes that shard them (wgrad,
contracting over tokens sharded across data-parallel devices). The first operand that names a
factor decides its sharding; the others are resharded to agree.

The per-device computation is the kernel itself, so the values are those of the kernel on each
shard: for the row-wise kernels (quantization, SwiGLU) the same bits as unsharded; for a GEMM
whose contraction is sharded, each device's partial result, in the GEMM's output dtype, is
added across devices in another order than within one (as XLA's own partitioned dot adds
them).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def parse(rule: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
  """("a b, c -> d" ->) ([("a", "b"), ("c",)], [("d",)])."""
  lhs, rhs = rule.split("->")
  side = lambda s: [tuple(part.split()) for part in s.split(",")]
  return side(lhs), side(rhs)


def _axes(spec_entry) -> tuple[str, ...]:
  if spec_entry is None:
    return ()
  return tuple(spec_entry) if isinstance(spec_entry, (tuple, list)) else (spec_entry,)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def choose(
  mesh,
  ins: Sequence[tuple[str, ...]],
  in_specs: Sequence[Sequence],
  in_shapes: Sequence[Sequence[int]],
  ties: Mapping[str, str],
  block: Mapping[str, int],
) -> dict[str, tuple[str, ...]]:
  """Mesh axes of each primary factor: from the first operand that names it, kept only where
  every operand dimension of the factor splits into whole blocks per device, and where no
  other factor already uses the axes."""
  sizes: dict[str, int] = {}
  for names, shape in zip(ins, in_shapes):
    for f, n in zip(names, shape):
      sizes.setdefault(f, n)
  out: dict[str, tuple[str, ...]] = {}
  used: set[str] = set()
  for names, spec in zip(ins, in_specs):
    spec = tuple(spec) + (None,) * (len(names) - len(spec))
    for f, entry in zip(names, spec):
      if f in ties or f in out:
        continue
      axes = tuple(a for a in _axes(entry) if a not in used)
      n = math.prod(mesh.shape[a] for a in axes) if axes else 1
      whole = block.get(f, 1)
      if axes and sizes[f] % (n * whole):
        axes = ()
      out[f] = axes
      used.update(axes)
  return out


def _spec(names, chosen, ties):
  return PartitionSpec(*(_entry(chosen.get(ties.get(f, f), ())) for f in names))


def sharded(
  fn: Callable,
  rule: str,
  *,
  ties: Optional[Mapping[str, str]] = None,
  block: Optional[Mapping[str, int]] = None,
  per_shard: Optional[Callable[[Mapping[str, tuple]], Callable]] = None,
):
  """`fn` (positional array arguments, an array or a tuple of arrays out, as `rule` lays them
  out) partitioned by `rule`; see the module doc. per_shard(chosen), given the mesh axes
  chosen for each factor, may return another function for each device to run (one that
  reduces across devices itself); None keeps fn."""
  ties = dict(ties or {})
  block = dict(block or {})
  ins, outs = parse(rule)
  primary = lambda f: ties.get(f, f)
  out_primary = {primary(f) for names in outs for f in names}
  in_factors = {f for names in ins for f in names}
  reduce = sorted({primary(f) for f in in_factors} - out_primary)  # summed across devices
  reduce_rule = tuple(sorted(f for f in in_factors if primary(f) not in out_primary))
  single = len(outs) == 1

  @custom_partitioning
  def call(*args):
    return fn(*args)

  def _chosen(mesh, arg_shapes):
    specs = [tuple(a.sharding.spec) for a in arg_shapes]
    return choose(mesh, ins, specs, [a.shape for a in arg_shapes], ties, block)

  def _out_shardings(mesh, chosen):
    res = [NamedSharding(mesh, _spec(names, chosen, ties)) for names in outs]
    return res[0] if single else tuple(res)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return _out_shardings(mesh, _chosen(mesh, arg_shapes))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    chosen = _chosen(mesh, arg_shapes)
    arg_shardings = tuple(NamedSharding(mesh, _spec(names, chosen, ties)) for names in ins)
    summed = tuple(a for f in reduce for a in chosen.get(f, ()))
    local = per_shard(chosen) if per_shard is not None else fn

    def lower(*args):
      y = local(*args)
      if summed:
        y = jax.tree_util.tree_map(lambda v: jax.lax.psum(v, summed), y)
      return y

    return mesh, lower, _out_shardings(mesh, chosen), arg_shardings

  call.def_partition(
    partition,
    infer_sharding_from_operands=infer,
    sharding_rule=rule,
    reduction_factors=reduce_rule,
  )
  return call
