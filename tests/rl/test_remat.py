"""The update's rematerialisation choice ("auto") against hand-computed activation bytes."""

import pytest

from jetrl import models as M
from jetrl.rl.remat import activation_bytes, device_memory_bytes, resolve_remat

H200 = 140 << 30


def test_activation_bytes_by_hand():
  c = M.get_config("qwen2.5-1.5b")  # d 1536, 12 heads of 128, 2 kv heads, d_ff 8960, 28 layers
  per_token = 2 * (6 * 1536 + 2 * 1536 + 2 * 256 + 5 * 8960)  # 115200
  assert activation_bytes(c, 16, 1024, flash=True) == 16 * 1024 * 28 * (per_token + 8 * 12)
  dense = per_token + 6 * 12 * 1024  # float32 + bf16 probabilities of every query
  assert activation_bytes(c, 16, 1024) == 16 * 1024 * 28 * dense


@pytest.mark.parametrize(
  "model, rows, flash, want",
  [
    ("qwen2.5-1.5b", 8, True, False),  # 24.6 GiB, under a quarter of 140: stored
    ("qwen2.5-1.5b", 8, False, True),  # 40.4 GiB with the probabilities: recomputed
    ("qwen2.5-1.5b", 16, True, True),  # 49.3 GiB: recomputed
  ],
)
def test_auto_remat_on_a_compile_target_uses_its_memory(model, rows, flash, want):
  c = M.get_config(model)
  assert device_memory_bytes(H200) == H200
  assert resolve_remat("auto", c, rows, 1024, flash=flash, memory_bytes=H200) is want
  # A device of 4 x the activations' bytes or less recomputes them; one of 5 x stores them.
  need = activation_bytes(c, rows, 1024, flash)
  assert resolve_remat("auto", c, rows, 1024, flash=flash, memory_bytes=4 * need - 4)
  assert not resolve_remat("auto", c, rows, 1024, flash=flash, memory_bytes=5 * need)
  assert resolve_remat("layer", c, 1, 8) and not resolve_remat("none", c, 16, 1024)
