"""Everything a resume reads from a checkpoint is checked: its arrays against their checksums
and its metadata (step, data position, config) against its own. One flipped digit in the
metadata once resumed a run with exit code 0, skipping a step or shifting the data."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.train.checkpoint import CheckpointError, Checkpointer


def tree(step: int) -> dict:
  return {"w": jnp.full((4, 4), float(step), jnp.float32), "step": jnp.asarray(step, jnp.int32)}


def saved(tmp_path, steps=(3, 6)):
  ck = Checkpointer(str(tmp_path), keep=3)
  for s in steps:
    ck.save(s, tree(s), {"step": s, "data_pos": 2 * s, "config": {"lr": 1e-4}})
  ck.close()
  return tmp_path / "checkpoints"


def metadata_file(directory, step):
  return directory / str(step) / "meta" / "metadata"


def restore(tmp_path):
  ck = Checkpointer(str(tmp_path), keep=3)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state, meta = ck.restore_latest(tree(0), log=lambda *a: None)
  ck.close()
  return state, meta, [str(w.message) for w in caught]


@pytest.mark.parametrize(
  "old, new",
  [('"step": 6', '"step": 7'), ('"data_pos": 12', '"data_pos": 13'), ('"lr": 0.0001', '"lr": 0.1')],
)
def test_an_edited_metadata_field_sets_the_checkpoint_aside(tmp_path, old, new):
  directory = saved(tmp_path)
  path = metadata_file(directory, 6)
  text = json.dumps(json.loads(path.read_text()))  # one canonical spelling to edit
  assert old in text
  path.write_text(text.replace(old, new))
  state, meta, messages = restore(tmp_path)
  assert meta["step"] == 3 and meta["data_pos"] == 6 and int(state["step"]) == 3
  assert any(
    "checkpoints/6 is damaged" in m and "does not match its checksum" in m for m in messages
  )
  assert sorted(p.name for p in directory.iterdir()) == ["3"]


def test_every_checkpoint_with_edited_metadata_is_an_error(tmp_path):
  directory = saved(tmp_path, steps=(6,))
  path = metadata_file(directory, 6)
  path.write_text(json.dumps(json.loads(path.read_text())).replace('"step": 6', '"step": 9'))
  with pytest.raises(CheckpointError, match="step 6: metadata unreadable.*does not match"):
    restore(tmp_path)


def test_any_changed_digit_of_the_metadata_is_found(tmp_path):
  """Each digit of the metadata file in turn (a sample of 12 positions) changed by one."""
  directory = saved(tmp_path, steps=(6,))
  path = metadata_file(directory, 6)
  original = path.read_text()
  positions = [m.start() for m in re.finditer(r"[0-9]", original)]
  sample = positions[:: max(1, len(positions) // 12)][:12]
  for k in sample:
    digit = str((int(original[k]) + 1) % 10)
    path.write_text(original[:k] + digit + original[k + 1 :])
    ck = Checkpointer(str(tmp_path), keep=3, create=False)
    with pytest.raises(ValueError, match="does not match its checksum"):
      ck.restore_meta(6)
    ck.close()
  path.write_text(original)
  _, meta, _ = restore(tmp_path)
  assert meta["step"] == 6 and meta["data_pos"] == 12
  np.testing.assert_array_equal(meta["config"]["lr"], 1e-4)


def test_a_full_disk_is_one_error_naming_the_path_and_the_free_space(tmp_path, monkeypatch):
  """Orbax reports a full disk deep inside its own errors (a 257-line traceback once)."""
  import errno
  import os

  from jetrl.train.checkpoint import SaveError

  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(3, tree(3), {"step": 3})

  def full(*args, **kwargs):
    try:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))
    except OSError as inner:
      raise RuntimeError("orbax: could not finalize the checkpoint") from inner

  monkeypatch.setattr(ck._mngr, "save", full)
  with pytest.raises(SaveError) as caught:
    ck.save(6, tree(6), {"step": 6})
  message = str(caught.value)
  assert "\n" not in message and isinstance(caught.value, CheckpointError)
  assert message.startswith(f"checkpoint 6 could not be written to {tmp_path}/checkpoints: ")
  assert "No space left on device" in message and re.search(r"\([0-9.]+ MiB free", message)

  def other(*args, **kwargs):
    raise RuntimeError("something else")

  monkeypatch.setattr(ck._mngr, "save", other)
  with pytest.raises(RuntimeError, match="something else"):
    ck.save(6, tree(6), {"step": 6})
  ck.close()


def _edit_meta(directory, step, edit, *, digest=False):
  """Rewrites checkpoint `step`'s metadata by `edit(meta)` (with a fresh checksum when
  `digest`: as if a version of jetrl had written it so)."""
  from jetrl.train.checkpoint import META_CHECKSUM, meta_digest

  path = metadata_file(directory, step)
  meta = json.loads(path.read_text())
  edit(meta)
  if digest:
    meta[META_CHECKSUM] = meta_digest(meta)
  path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
  "edit",
  [
    lambda m: (m.pop("meta_checksum"), m.update(step=7)),
    lambda m: m.pop("meta_checksum"),
    lambda m: (m.pop("meta_checksum"), m.pop("checksums")),
    lambda m: (m.pop("meta_checksum"), m.update(data_pos=13)),
  ],
  ids=["no-checksum-step-edited", "no-checksum", "no-checksums-at-all", "no-checksum-data-pos"],
)
def test_a_removed_metadata_checksum_is_damage_not_an_old_checkpoint(tmp_path, edit):
  """Deleting `meta_checksum` once turned the check off: an edited step resumed with only a
  warning (steps skipped, the log naming a folder that does not exist)."""
  directory = saved(tmp_path)
  _edit_meta(directory, 6, edit)
  ck = Checkpointer(str(tmp_path), keep=3)
  logs = []
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    state, meta = ck.restore_latest(tree(0), log=logs.append)
  assert meta["step"] == 3 and meta["data_pos"] == 6 and int(state["step"]) == 3
  assert ck.restored == str(directory / "3")
  ck.close()
  assert any(
    "checkpoints/6 is damaged" in m and "the metadata has no meta_checksum" in m for m in logs
  ), logs
  assert sorted(p.name for p in directory.iterdir()) == ["3"]
  assert [p.name.split("-")[0] for p in (tmp_path / "checkpoints_damaged").iterdir()] == ["6"]


def test_a_step_that_is_not_its_folders_is_set_aside_even_with_a_matching_checksum(tmp_path):
  directory = saved(tmp_path)
  _edit_meta(directory, 6, lambda m: m.update(step=7), digest=True)
  ck = Checkpointer(str(tmp_path), keep=3)
  logs = []
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    _, meta = ck.restore_latest(tree(0), log=logs.append)
  assert meta["step"] == 3 and ck.restored == str(directory / "3")
  ck.close()
  assert any("the metadata says step 7, its folder is step 6" in m for m in logs), logs


def test_a_save_whose_metadata_names_another_step_is_refused(tmp_path):
  ck = Checkpointer(str(tmp_path), keep=3)
  with pytest.raises(ValueError, match="checkpoint 4: its metadata says step 5"):
    ck.save(4, tree(4), {"step": 5})
  assert ck.steps() == []
  ck.close()


@pytest.mark.parametrize("shape", [(4, 8), (2, 4), (4,)])
def test_a_checkpoint_of_other_array_shapes_is_never_restored_into_this_run(tmp_path, shape):
  """Optimizer-state (or LoRA adapter) shapes that differ from the run's: orbax must not
  pad, truncate or reshape them into the run's arrays; the checkpoint is set aside."""
  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(3, tree(3), {"step": 3})
  ck.save(6, {"w": jnp.full(shape, 6.0, jnp.float32), "step": jnp.asarray(6, jnp.int32)}, {})
  ck.close()
  state, meta, messages = restore(tmp_path)
  assert meta["step"] == 3
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 4), 3.0, np.float32))
  assert any("checkpoints/6 is damaged" in m for m in messages), messages


@pytest.mark.parametrize(
  "path, value, flag",
  [
    (("seed",), 7, "--seed: checkpoint has 7, this run has 0"),
    (("recipe",), "jet", "--recipe: checkpoint has 'jet', this run has 'bf16'"),
    (("lora", "rank"), 8, "--lora.rank: checkpoint has 8, this run has 4"),
  ],
)
def test_a_checkpoint_of_another_seed_recipe_or_lora_rank_is_refused(tmp_path, path, value, flag):
  """Even with its metadata's checksum rewritten to match, a checkpoint whose configuration
  differs is refused before any array is read."""
  from jetrl.config import FlagError
  from jetrl.train import TrainConfig, resume

  cfg = TrainConfig(workdir=str(tmp_path), recipe="bf16").replace(lora={"rank": 4})
  ck = Checkpointer(str(tmp_path), keep=3)
  config = cfg.to_dict()
  node = config
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value
  ck.save(6, tree(6), {"data_pos": 12, "kind": "rl", "config": config})
  check = resume.resume_check(cfg, ck.directory, [], kind="rl")
  with pytest.raises(FlagError, match="written with other settings") as caught:
    ck.restore_latest(tree(0), check, log=lambda *a: None)
  assert flag in str(caught.value)
  assert ck.steps() == [6]  # refused, not set aside: the flags can be given to resume it
  ck.close()


# kill -9 at each moment of a save, simulated on a real checkpoint: what a save leaves when it
# is cut short there (tests/train/test_checkpoint_integrity.py kills a real save at three
# moments). A resume restores the newest intact checkpoint, bit for bit.


def random_tree(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {
    "w": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
    "b": jnp.asarray(rng.standard_normal(96), jnp.bfloat16),
    "step": jnp.asarray(step, jnp.int32),
  }


def _files(step_dir, pattern):
  return sorted(step_dir.glob(pattern), key=lambda p: (-p.stat().st_size, str(p)))


def _cut(path):
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


STAGES = {
  # Orbax writes into <step>.orbax-checkpoint-tmp-<time> and renames it when complete.
  "a temporary folder with part of the state": lambda d: (
    shutil.rmtree(d / "meta"),
    d.rename(d.with_name("9.orbax-checkpoint-tmp-1765000000")),
  ),
  "a complete temporary folder, not renamed": lambda d: d.rename(
    d.with_name("9.orbax-checkpoint-tmp-1765000000")
  ),
  "renamed, before the metadata": lambda d: shutil.rmtree(d / "meta"),
  "renamed, the metadata torn": lambda d: _cut(d / "meta" / "metadata"),
  "renamed, the state missing": lambda d: shutil.rmtree(d / "state"),
  "renamed, an array file torn": lambda d: _cut(_files(d / "state", "**/d/*")[0]),
  "renamed, every array file empty": lambda d: [
    p.write_bytes(b"") for p in _files(d / "state", "**/d/*")
  ],
  "renamed, the array index missing": lambda d: [
    p.unlink() for p in _files(d / "state", "**/manifest.ocdbt")
  ],
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_save_cut_short_at_any_stage_resumes_from_the_last_intact_one_bit_exact(tmp_path, stage):
  ck = Checkpointer(str(tmp_path), keep=3)
  for s in (3, 6, 9):
    ck.save(s, random_tree(s), {"data_pos": 2 * s})
  ck.close()
  STAGES[stage](tmp_path / "checkpoints" / "9")
  target = jax.tree_util.tree_map(jnp.zeros_like, random_tree(0))
  ck = Checkpointer(str(tmp_path), keep=3)
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    state, meta = ck.restore_latest(target, log=lambda *a: None)
  assert meta["step"] == 6 and meta["data_pos"] == 12
  assert ck.restored == str(tmp_path / "checkpoints" / "6")
  ck.close()
  assert_bits(state, random_tree(6))
  # The next save of step 9 succeeds where the cut one was.
  ck = Checkpointer(str(tmp_path), keep=3)
  ck.save(9, random_tree(9), {"data_pos": 18})
  state, meta = ck.restore_latest(target, log=lambda *a: None)
  assert meta["step"] == 9
  assert_bits(state, random_tree(9))
  ck.close()


def test_a_step_missing_only_orbax_s_index_of_its_state_is_whole_and_restored(tmp_path):
  """state/_METADATA (Orbax's description of the tree) gone: the arrays still read and match
  their checksums, so the checkpoint is intact and restored bit for bit."""
  ck = Checkpointer(str(tmp_path), keep=3)
  for s in (6, 9):
    ck.save(s, random_tree(s), {"data_pos": 2 * s})
  ck.close()
  (tmp_path / "checkpoints" / "9" / "state" / "_METADATA").unlink()
  ck = Checkpointer(str(tmp_path), keep=3)
  target = jax.tree_util.tree_map(jnp.zeros_like, random_tree(0))
  state, meta = ck.restore_latest(target, log=lambda *a: None)
  ck.close()
  assert meta["step"] == 9
  assert_bits(state, random_tree(9))


def assert_bits(state, want):
  for key in want:
    got, expected = np.asarray(state[key]), np.asarray(want[key])
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes(), key  # bit for bit
