"""The device mesh, parsed from a flag string (multi-host start-up: `jetrl.parallel.hosts`).

`--mesh=data:2,fsdp:2,tensor:2` names the size of each axis; axes left out have size 1 and the
empty string puts every device on `data`. Axis order is fixed (data, fsdp, tensor): `tensor` is
the innermost axis, so on a multi-device host its shards sit on neighbouring devices (fastest
links) and `data` spans hosts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
AXES = (DATA, FSDP, TENSOR)


def parse_mesh(spec: str) -> dict[str, int]:
  """{'data': d, 'fsdp': f, 'tensor': t} from "data:2,fsdp:2,tensor:2" (no device check).

  An axis left out has size 1; one axis may be given as -1 (all remaining devices). The empty
  string is {'data': -1}. Unknown axis names, repeats, and non-integer or non-positive sizes
  raise a ValueError.
  """
  if not isinstance(spec, str):
    raise ValueError(f"mesh must be a string like 'data:2,fsdp:2,tensor:2', got {spec!r}")
  sizes = {DATA: 1, FSDP: 1, TENSOR: 1}
  text = spec.replace(" ", "")
  if not text:
    return {DATA: -1, FSDP: 1, TENSOR: 1}
  seen = set()
  for part in text.split(","):
    name, sep, value = part.partition(":")
    if not sep or not name or not value:
      raise ValueError(
        f"mesh {spec!r}: entry {part!r} is not 'axis:size'; expected e.g. "
        f"'data:2,fsdp:2,tensor:2' with axes {list(AXES)}"
      )
    if name not in AXES:
      raise ValueError(f"mesh {spec!r}: unknown axis {name!r}; accepted axes: {list(AXES)}")
    if name in seen:
      raise ValueError(f"mesh {spec!r}: axis {name!r} is given twice")
    seen.add(name)
    try:
      size = int(value)
    except ValueError:
      raise ValueError(
        f"mesh {spec!r}: size of axis {name!r} must be an integer, got {value!r}"
      ) from None
    if size < 1 and size != -1:
      raise ValueError(
        f"mesh {spec!r}: size of axis {name!r} must be >= 1 (or -1 for the "
        f"remaining devices), got {size}"
      )
    sizes[name] = size
  if sum(v == -1 for v in sizes.values()) > 1:
    raise ValueError(f"mesh {spec!r}: at most one axis may be -1")
  return sizes


def resolve_mesh_shape(spec: str, n_devices: int) -> dict[str, int]:
  """Axis sizes for `n_devices` devices; ValueError if their product is not the device count."""
  sizes = parse_mesh(spec)
  fixed = int(np.prod([v for v in sizes.values() if v != -1]))
  if -1 in sizes.values():
    if n_devices % fixed:
      raise ValueError(
        f"mesh {spec!r}: the fixed axes (product {fixed}) do not divide the {n_devices} devices"
      )
    sizes = {k: (n_devices // fixed if v == -1 else v) for k, v in sizes.items()}
  total = int(np.prod(list(sizes.values())))
  if total != n_devices:
    raise ValueError(
      f"mesh {spec!r}: axis sizes {sizes} multiply to {total}, but there are {n_devices} "
      f"devices; the product of the axis sizes must equal the device count (leave an axis "
      f"out, or give one axis as -1, to use the remaining devices)"
    )
  return sizes


def make_mesh(spec: str = "", devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A Mesh with axes (data, fsdp, tensor) over `devices` (default: all devices, all hosts)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_mesh_shape(spec, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  try:
    # Auto axes: jit propagates shardings from the inputs (no sharding-in-types rules).
    return jax.make_mesh(
      shape, AXES, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES)
    )
  except (ValueError, NotImplementedError):
    # make_mesh may refuse shapes it cannot map onto the physical topology; a plain reshape
    # of the device list is always valid.
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def mesh_str(mesh: Mesh) -> str:
  return ",".join(f"{a}:{mesh.shape[a]}" for a in mesh.axis_names)
