"""The layout of a GGUF file checked before the `gguf` package reads it.

`gguf.GGUFReader` trusts every length the file declares: a 45-byte file that declares an array
of 2**62 items once kept it looping without end. `check_layout(path)` walks the header itself
(the magic, the version, the tensor and metadata counts, each key, value, string and array,
each tensor's name, dimensions, type and offset) and checks every declared length against the
bytes left before it is read, and every tensor's data against the end of the file; anything
else is a ValueError naming the file, the offset and what was declared. It reads the header
through a memory map, touching nothing of the tensor data.

Format (little- or big-endian, versions 2 and 3; the GGUF specification in the ggml repository): "GGUF", u32 version,
u64 tensor count, u64 metadata count; each metadata entry a string key, a u32 value type and a
value (a string: u64 length + bytes; an array: u32 item type, u64 count, the items); each
tensor a string name, u32 dimension count, u64 dimensions, u32 ggml type, u64 offset into the
data, which starts at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Optional

MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALARS = {  # value type -> struct code
  0: "B",
  1: "b",
  2: "H",
  3: "h",
  4: "I",
  5: "i",
  6: "f",
  7: "?",
  10: "Q",
  11: "q",
  12: "d",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
  def __init__(self, data: bytes, path: str, order: str):
    self.data, self.path, self.order, self.pos = data, path, order, 0

  def left(self) -> int:
    return len(self.data) - self.pos

  def fail(self, what: str) -> ValueError:
    return ValueError(f"{self.path}: not a readable GGUF file: at byte {self.pos}, {what}")

  def skip(self, n: int, what: str) -> None:
    if n > self.left():
      raise self.fail(f"{what} needs {n} bytes, {self.left()} are left")
    self.pos += n

  def take(self, n: int, what: str) -> bytes:
    self.skip(n, what)
    return self.data[self.pos - n : self.pos]

  def unpack(self, code: str, what: str) -> Any:
    return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

  def count(self, what: str, each: int) -> int:
    """A declared u64 count of items of at least `each` bytes, checked against what is left."""
    n = self.unpack("Q", what)
    if n * each > self.left():
      raise self.fail(
        f"{what} declares {n} items (at least {n * each} bytes), {self.left()} are left"
      )
    return n

  def string(self, what: str) -> bytes:
    return self.take(self.count(f"the length of {what}", 1), what)


def _skip_value(c: _Cursor, kind: int, what: str, depth: int = 0) -> Any:
  """Reads (a scalar, a string) or skips (an array) one value of type `kind`."""
  if kind in _SCALARS:
    return c.unpack(_SCALARS[kind], what)
  if kind == _STRING:
    return c.string(what)
  if kind != _ARRAY:
    raise c.fail(f"{what} has value type {kind}, which is none of GGUF's")
  if depth > 2:
    raise c.fail(f"{what} nests arrays more than 3 deep")
  item = c.unpack("I", f"the item type of {what}")
  if item in _SCALARS:
    n = c.count(f"the item count of {what}", struct.calcsize(_SCALARS[item]))
    c.skip(n * struct.calcsize(_SCALARS[item]), what)
    return None
  n = c.count(f"the item count of {what}", 8 if item == _STRING else 12)
  for k in range(n):
    _skip_value(c, item, f"{what}[{k}]", depth + 1)
  return None


def check_layout(path: str, sizes: Optional[dict] = None) -> None:
  """ValueError unless every length the GGUF file at `path` declares fits in it (see the
  module's doc). `sizes`: {ggml type: (block size, bytes per block)}, `gguf.GGML_QUANT_SIZES`
  by default; a tensor of a type not in it is refused."""
  if sizes is None:
    from gguf import GGML_QUANT_SIZES  # pylint: disable=import-outside-toplevel

    sizes = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
  with open(path, "rb") as f:
    if len(f.read(24)) < 24:
      raise ValueError(f"{path}: not a readable GGUF file (shorter than its header)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      _check(data, path, sizes)


def _check(data, path: str, sizes: dict) -> None:
  size = len(data)
  if data[:4] != b"GGUF":
    raise ValueError(f"{path}: not a readable GGUF file (it does not start with GGUF)")
  order = "<" if struct.unpack("<I", data[4:8])[0] & 0xFFFF else ">"
  version = struct.unpack(order + "I", data[4:8])[0]
  if version not in (2, 3):
    raise ValueError(f"{path}: GGUF version {version} is not read (2 and 3 are)")
  c = _Cursor(data, path, order)
  c.pos = 8
  alignment, tensors = _walk(c, sizes)
  start = -(-c.pos // alignment) * alignment
  for name, offset, nbytes in tensors:
    if offset % alignment or start + offset + nbytes > size:
      raise ValueError(
        f"{path}: not a readable GGUF file: tensor {name!r} declares {nbytes} bytes at data "
        f"offset {offset}, past the end of the file ({size} bytes, data from byte {start}) "
        f"or not aligned to {alignment}"
      )


def _walk(c: _Cursor, sizes: dict) -> tuple[int, list]:
  """(alignment, the tensors' (name, offset, bytes)) after checking every count, key, value
  and tensor info; `c` is left at the end of the header."""
  n_tensors = c.count("the tensor count", 8 + 4 + 4 + 8)
  n_kv = c.count("the metadata count", 8 + 4)
  alignment = 32
  for k in range(n_kv):
    key = c.string(f"metadata key {k}").decode("utf-8", "replace")
    kind = c.unpack("I", f"the value type of {key!r}")
    value = _skip_value(c, kind, f"metadata {key!r}")
    if key == "general.alignment":
      if not isinstance(value, int) or value < 1 or value > 2**16 or value & (value - 1):
        raise c.fail(f"general.alignment is {value!r}, not a power of two up to 65536")
      alignment = value
  tensors = []
  for k in range(n_tensors):
    name = c.string(f"the name of tensor {k}").decode("utf-8", "replace")
    n_dims = c.unpack("I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise c.fail(f"tensor {name!r} declares {n_dims} dimensions (1 to {MAX_DIMS} are read)")
    dims = [c.unpack("Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
    kind = c.unpack("I", f"the type of tensor {name!r}")
    offset = c.unpack("Q", f"the data offset of tensor {name!r}")
    if kind not in sizes:
      raise c.fail(f"tensor {name!r} has ggml type {kind}, which is not read")
    block, block_bytes = sizes[kind]
    elements = 1
    for d in dims:
      elements *= d
    if elements == 0 or elements > 2**48 or dims[0] % block:
      raise c.fail(
        f"tensor {name!r} declares dimensions {dims} ({elements} elements; each row a "
        f"multiple of {block})"
      )
    tensors.append((name, offset, elements // block * block_bytes))
  return alignment, tensors
