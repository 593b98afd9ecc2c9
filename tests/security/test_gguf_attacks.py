"""Every length a GGUF file declares is checked against the bytes left before it is read: a
48-byte file declaring an array of 2**62 items once kept `convert_gguf` (the `gguf` package's
reader) looping without end."""

from __future__ import annotations

import contextlib
import signal
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jetrl.models.io import gguf_import  # noqa: E402
from jetrl.models.io.gguf_layout import check_layout  # noqa: E402

HEAD = b"GGUF" + struct.pack("<I", 3)


@contextlib.contextmanager
def within(seconds: int):
  def stop(*_):
    raise TimeoutError(f"still running after {seconds} s")

  old = signal.signal(signal.SIGALRM, stop)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def kv(key: bytes, kind: int, value: bytes) -> bytes:
  return struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + value


def tensor(name: bytes, dims, kind=0, offset=0) -> bytes:
  return (
    struct.pack("<Q", len(name))
    + name
    + struct.pack("<I", len(dims))
    + b"".join(struct.pack("<Q", d) for d in dims)
    + struct.pack("<IQ", kind, offset)
  )


HUGE = 2**62
CASES = {
  "array of 2**62 bytes": HEAD + struct.pack("<QQ", 0, 1) + kv(b"", 9, struct.pack("<IQ", 0, HUGE)),
  "array of 2**62 strings": HEAD
  + struct.pack("<QQ", 0, 1)
  + kv(b"a", 9, struct.pack("<IQ", 8, HUGE)),
  "string of 2**62 bytes": HEAD
  + struct.pack("<QQ", 0, 1)
  + kv(b"a", 8, struct.pack("<Q", HUGE) + b"x"),
  "key of 2**62 bytes": HEAD + struct.pack("<QQQ", 0, 1, HUGE),
  "2**62 metadata entries": HEAD + struct.pack("<QQ", 0, HUGE) + b"\0" * 20,
  "2**62 tensors": HEAD + struct.pack("<QQ", HUGE, 0) + b"\0" * 20,
  "nested arrays of 2**62": HEAD
  + struct.pack("<QQ", 0, 1)
  + kv(b"a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, HUGE)),
  "a tensor of 2**62 x 2**62 floats": HEAD + struct.pack("<QQ", 1, 0) + tensor(b"t", [HUGE, HUGE]),
  "a tensor of 1000 dimensions": HEAD + struct.pack("<QQ", 1, 0) + tensor(b"t", [1] * 1000),
  "a tensor past the end": HEAD + struct.pack("<QQ", 1, 0) + tensor(b"t", [4], offset=2**40),
  "a tensor of a type unknown": HEAD + struct.pack("<QQ", 1, 0) + tensor(b"t", [4], kind=999),
}


@pytest.mark.parametrize("data", list(CASES.values()), ids=list(CASES))
def test_a_declared_length_beyond_the_file_is_refused_at_once(tmp_path, data):
  path = tmp_path / "m.gguf"
  path.write_bytes(data)
  with within(20), pytest.raises(ValueError, match=rf"^{path}: not a readable GGUF file: "):
    check_layout(str(path))
  with within(20), pytest.raises(ValueError, match="not a readable GGUF file"):
    gguf_import.convert_gguf(str(path), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_the_message_names_the_offset_and_what_was_declared(tmp_path):
  path = tmp_path / "m.gguf"
  path.write_bytes(CASES["array of 2**62 bytes"])
  assert len(path.read_bytes()) == 48
  with pytest.raises(ValueError) as caught:
    check_layout(str(path))
  assert str(caught.value) == (
    f"{path}: not a readable GGUF file: at byte 48, the item count of metadata '' declares "
    f"{HUGE} items (at least {HUGE} bytes), 0 are left"
  )


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "ok.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_uint32("llama.block_count", 1)
  w.add_array("tokenizer.ggml.tokens", ["a", "b", "cc"])
  w.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])
  w.add_string("general.name", "tiny")
  w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
  w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path.read_bytes()


def test_a_valid_file_passes_and_every_cut_of_it_is_refused(tmp_path, valid):
  path = tmp_path / "m.gguf"
  path.write_bytes(valid)
  check_layout(str(path))
  reader = gguf.GGUFReader(str(path))
  assert [t.name for t in reader.tensors] == ["token_embd.weight", "output_norm.weight"]
  with within(60):
    for n in range(len(valid)):
      path.write_bytes(valid[:n])
      with pytest.raises(ValueError, match="GGUF"):
        check_layout(str(path))


def test_any_changed_header_byte_is_refused_or_read_within_the_file(tmp_path, valid):
  """Each byte of the header set to 0xff in turn: refused, or (a value that still fits) read
  by the reader without running past the file."""
  path = tmp_path / "m.gguf"
  header = gguf.GGUFReader(_write(path, valid)).data_offset
  with within(120):
    for k in range(8, header):
      changed = bytearray(valid)
      changed[k] = 0xFF
      path.write_bytes(bytes(changed))
      try:
        check_layout(str(path))
      except ValueError:
        continue
      try:
        gguf.GGUFReader(str(path))  # it terminates; its own errors (a bad UTF-8 key) are fine
      except TimeoutError:
        raise
      except Exception:  # pylint: disable=broad-except
        pass


def _write(path, data: bytes) -> str:
  path.write_bytes(data)
  return str(path)
