"""Checkpoint checksums: one flipped bit is found, a damaged checkpoint is set aside and the
newest intact one restored, nothing non-finite is saved."""

import glob
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.train.checkpoint import DAMAGED_DIR, CheckpointError, Checkpointer
from jetrl.train.checksum import mismatches, non_finite, tree_checksums


def small_tree(offset=0.0):
  return {
    "w": jnp.arange(20000, dtype=jnp.float32).reshape(100, 200) / 7 + offset,
    "b": (jnp.arange(64, dtype=jnp.float32) + offset).astype(jnp.bfloat16),
    "count": jnp.int32(3),
    "flag": jnp.array([True, False]),
  }


def test_one_flipped_bit_in_any_leaf_is_found():
  tree = jax.tree_util.tree_map(np.asarray, small_tree())
  saved = tree_checksums(tree)
  assert tree_checksums(jax.tree_util.tree_map(np.copy, tree)) == saved
  rng = np.random.default_rng(0)
  for name, nbits in (("w", 32), ("b", 16), ("count", 32)):
    for _ in range(5):
      changed = jax.tree_util.tree_map(np.copy, tree)
      flat = changed[name].reshape(-1).view(np.uint32 if nbits == 32 else np.uint16)
      flat[rng.integers(flat.size)] ^= np.array(1 << int(rng.integers(nbits)), flat.dtype)
      assert mismatches(saved, changed) == [f"['{name}']"]
  swapped = dict(tree, w=tree["w"][::-1].copy())  # same values, other places
  assert mismatches(saved, swapped) == ["['w']"]


def test_non_finite_names_the_leaf():
  tree = small_tree()
  assert non_finite(tree) == []
  tree["w"] = tree["w"].at[5, 5].set(jnp.inf)
  assert non_finite(tree) == ["['w']"]


def _flip_data_bytes(step_dir):
  """Flips bits in the middle of the largest array file, as disk damage would."""
  files = sorted(
    glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize
  )
  data = bytearray(open(files[-1], "rb").read())
  for k in range(len(data) // 2, len(data) // 2 + 8):
    data[k] ^= 0x10
  with open(files[-1], "wb") as f:
    f.write(bytes(data))


def test_damaged_latest_checkpoint_falls_back_to_the_intact_one(tmp_path):
  ck = Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2, 3):
    ck.save(step, small_tree(step), {"step": step})
  ck.close()
  _flip_data_bytes(tmp_path / "checkpoints" / "3")  # values silently changed
  with open(tmp_path / "checkpoints" / "2" / "meta" / "metadata", "w") as f:
    f.write('{"step": 2, "chec')  # a torn metadata file
  ck = Checkpointer(str(tmp_path), keep=3)
  logs = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state, meta = ck.restore_latest(small_tree(), log=logs.append)
  assert meta["step"] == 1
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_tree(1)["w"]))
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert any(
    "checkpoints/3 is damaged" in m and "do not match their checksums" in m for m in messages
  ), messages
  assert any("checkpoints/2 is damaged" in m and "metadata" in m for m in messages), messages
  assert ck.steps() == [1] and len(os.listdir(tmp_path / DAMAGED_DIR)) == 2
  ck.save(2, small_tree(2), {"step": 2})  # the step numbers are free again
  ck.close()


def test_no_intact_checkpoint_is_an_error_not_a_restart(tmp_path):
  ck = Checkpointer(str(tmp_path), keep=2)
  ck.save(1, small_tree(1), {"step": 1})
  ck.close()
  _flip_data_bytes(tmp_path / "checkpoints" / "1")
  ck = Checkpointer(str(tmp_path), keep=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(CheckpointError, match="(?s)no intact checkpoint.*step 1: ValueError"):
      ck.restore_latest(small_tree(), log=lambda *a: None)
  assert Checkpointer(str(tmp_path / "empty")).restore_latest(small_tree()) is None


def test_non_finite_state_is_never_saved(tmp_path):
  ck = Checkpointer(str(tmp_path))
  bad = small_tree()
  bad["w"] = bad["w"].at[0, 0].set(jnp.nan)
  with pytest.raises(
    ValueError,
    match=r"refusing to save checkpoint 1: non-finite values in "
    r"\[\"\['w'\]\"\]",
  ):
    ck.save(1, bad, {"step": 1})
  assert ck.latest_step() is None


SAVER = """
import sys
import jax.numpy as jnp
from jetrl.train.checkpoint import Checkpointer

ck = Checkpointer(sys.argv[1], keep=3)
tree = lambda v: {"w": jnp.full((48, 1024, 1024), v, jnp.float32), "step": jnp.int32(v)}
ck.save(1, tree(1.0), {"step": 1})
print("saved 1", flush=True)
ck.save(2, tree(2.0), {"step": 2})
print("saved 2", flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.3])
def test_a_save_killed_midway_never_becomes_the_latest(tmp_path, delay_s):
  """kill -9 while step 2's 200 MB are being written: a fresh Checkpointer lists only complete
  checkpoints and restores step 1 (its values checked by hand), or step 2 whole if the save
  had finished by the time the signal landed."""
  import signal
  import subprocess
  import sys
  import time

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    [sys.executable, "-c", SAVER, str(tmp_path)],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == "saved 1", proc.stderr.read()[-2000:]
  ckdir = tmp_path / "checkpoints"
  deadline = time.time() + 120
  while not [n for n in os.listdir(ckdir) if n != "1"] and time.time() < deadline:
    time.sleep(0.001)  # step 2's save has started once anything but "1" is there
  time.sleep(delay_s)
  in_flight = sorted(os.listdir(ckdir))
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  ck = Checkpointer(str(tmp_path), keep=3)
  template = {"w": jnp.zeros((48, 1024, 1024), jnp.float32), "step": jnp.int32(0)}
  state, meta = ck.restore_latest(template, log=lambda m: None)
  if delay_s == 0.0:  # Orbax writes into a temporary directory and renames it when complete
    assert any(n.startswith("2.") for n in in_flight), in_flight
  if ck.steps() == [1]:
    assert meta["step"] == 1 and int(state["step"]) == 1
    assert float(state["w"].min()) == float(state["w"].max()) == 1.0
  else:  # the save completed before the kill: it must then be whole
    assert ck.steps() == [1, 2], (ck.steps(), in_flight)
    assert meta["step"] == 2 and float(state["w"].min()) == float(state["w"].max()) == 2.0


def _save_without_checksums(ck, step, tree):
  """A checkpoint as one written without checksums in its metadata leaves it."""
  import orbax.checkpoint as ocp

  ck._mngr.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave({"step": step})
    ),
    force=True,
  )
  ck._mngr.wait_until_finished()


def test_a_checkpoint_without_checksums_is_set_aside_as_damaged(tmp_path):
  """Every checkpoint is written with checksums; one without them cannot be told from one whose
  checksums were removed, so it is damaged (it was once restored with a warning)."""
  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(1, small_tree(1), {"step": 1})
  _save_without_checksums(ck, 2, small_tree(2))
  ck.close()
  ck = Checkpointer(str(tmp_path), keep=3)
  logs = []
  with pytest.warns(RuntimeWarning, match="checkpoints/2 is damaged"):
    state, meta = ck.restore_latest(small_tree(), log=logs.append)
  assert meta["step"] == 1 and ck.steps() == [1]
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_tree(1)["w"]))
  assert any("has no meta_checksum and no checksums" in m for m in logs), logs
  ck.close()
