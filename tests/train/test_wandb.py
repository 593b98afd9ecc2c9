"""Weights & Biases beside TensorBoard (`--logging.wandb`, offline: no network) and the
completions table (`--logging.samples_every`, `--logging.samples_rows`), on runs of the tiny
model: W&B's history holds metrics.jsonl's values, a resumed run continues the same W&B run,
the samples reach samples.jsonl, W&B's table and TensorBoard's text, and a missing wandb
package is a one-line error before anything starts.

W&B's offline run is read back from its own files: the `.wandb` transaction log (a leveldb-style
log of `wandb_internal_pb2.Record` protos; wandb ships no reader of it) and the table files it
writes under files/media."""

import glob
import json
import os
import shutil
import struct
import sys

import pytest

from conftest import quiet
from jetrl.config import FlagError
from jetrl.train import LoggingConfig, TrainConfig, run
from jetrl.train.writers import read_jsonl

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

KEYS = ("reward_mean", "accuracy", "loss", "grad_norm", "agree/abs_diff_mean")


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """wandb's environment: offline, silent, its own folders under tmp_path, no credentials."""
  home = tmp_path / "wandb_home"
  for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(home / name.lower()))
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.delenv("WANDB_BASE_URL", raising=False)


def wandb_records(path: str) -> list:
  """The records of a `.wandb` file: a 7-byte header (":W&B", magic, version), then 32 KiB
  blocks of chunks (crc32c, uint16 length, type: 1 full, 2 first, 3 middle, 4 last); a block's
  tail shorter than a chunk header is zero padding."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:7]
  block, at, records, pending = 32768, 7, [], b""
  while at + 7 <= len(data):
    if block - at % block < 7:
      at += block - at % block
      continue
    length, kind = struct.unpack("<HB", data[at + 4 : at + 7])
    if length == 0 and kind == 0:  # the rest of the block is padding
      at += block - at % block
      continue
    pending += data[at + 7 : at + 7 + length]
    at += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def offline_runs(workdir) -> list[dict]:
  """Each offline run folder under <workdir>/wandb, oldest first: its run id, config and
  history ({step: {key: value}})."""
  runs = []
  for folder in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))):
    (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    found = {"folder": folder, "history": {}}
    for r in wandb_records(path):
      kind = r.WhichOneof("record_type")
      if kind == "run":
        found["id"], found["name"] = r.run.run_id, r.run.display_name
        found["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
      elif kind == "history":
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        found["history"].setdefault(int(items["_step"]), {}).update(items)
    runs.append(found)
  return runs


def tensorboard_texts(directory) -> dict[int, str]:
  """{step: text} of the "samples" text tag in every event file of `directory`."""
  from conftest import tensorboard_events

  texts = {}
  for event in tensorboard_events(directory):
    for v in event.summary.value:
      if v.tag.startswith("samples"):
        texts[event.step] = v.tensor.string_val[0].decode()
  return texts


def test_the_completions_table_is_on_by_default_at_a_small_size():
  assert LoggingConfig().samples_every == 10 and LoggingConfig().samples_rows == 4
  assert TrainConfig().logging.samples_every == 10 and TrainConfig().logging.wandb is False
  assert TrainConfig().logging.wandb_mode == "offline"
  with pytest.raises(ValueError, match=r"wandb_mode: 'cloud' is not accepted"):
    LoggingConfig(wandb_mode="cloud")


def test_wandb_mirrors_the_metrics_and_a_resume_continues_its_run(
  tmp_path, offline, tiny_train_config
):
  workdir = tmp_path / "run"
  logging = {"wandb": True, "tensorboard": True, "samples_every": 2, "samples_rows": 3}
  cfg = tiny_train_config(workdir, logging=logging)
  run(cfg, log=quiet)
  (run_id,) = open(workdir / "wandb_id").read().split()
  (first,) = offline_runs(workdir)
  assert first["id"] == run_id and first["name"] == "run"
  assert first["config"]["recipe"] == "bf16"
  assert first["config"]["logging"]["wandb"] is True

  # Resume to step 3 from checkpoint 1 (checkpoint 2 gone): step 2 is done again.
  shutil.rmtree(workdir / "checkpoints" / "2")
  run(cfg.replace(steps=3), log=quiet)
  assert open(workdir / "wandb_id").read().split() == [run_id]
  runs = offline_runs(workdir)
  assert len(runs) == 2 and {r["id"] for r in runs} == {run_id}
  second = runs[1]["history"]
  assert sorted(first["history"]) == [0, 1, 2] and sorted(second) == [2, 3]
  # The redone step carries the same values (W&B keeps the first step 2 it holds).
  for key in KEYS:
    assert second[2][key] == first["history"][2][key], key

  history = {**second, **first["history"]}
  metrics = read_jsonl(str(workdir / "metrics.jsonl"))
  assert [m["step"] for m in metrics] == [1, 2, 3]
  for m in metrics:
    for key in KEYS:
      assert history[m["step"]][key] == pytest.approx(m[key], rel=1e-6), (m["step"], key)
  evals = read_jsonl(str(workdir / "eval.jsonl"))
  assert [e["step"] for e in evals] == [0, 3]
  for e in evals:
    assert history[e["step"]]["eval/accuracy"] == e["eval_accuracy"]

  # The completions table: one row of each of step 2's 2 prompts (every 2nd step; 3 asked),
  # in samples.jsonl, in W&B's table and in TensorBoard's text.
  samples = read_jsonl(str(workdir / "samples.jsonl"))
  assert [(s["step"], s["row"]) for s in samples] == [(2, 0), (2, 2)]
  tables = sorted(glob.glob(os.path.join(runs[0]["folder"], "files/media/table/samples_2_*")))
  table = json.load(open(tables[0]))
  assert table["columns"][:4] == ["step", "row", "prompt", "completion"]
  assert [row[:4] for row in table["data"]] == [
    [s["step"], s["row"], s["prompt"], s["completion"]] for s in samples
  ]
  assert history[2]["samples/nrows"] == 2 and history[2]["samples/_type"] == "table-file"
  texts = tensorboard_texts(workdir / "tb")
  assert sorted(texts) == [2]
  assert len(texts[2].split("\n")) == 2 + 2 and samples[0]["prompt"].split("\n")[0] in texts[2]


def test_a_missing_wandb_package_is_one_line_before_the_run_starts(
  tmp_path, monkeypatch, tiny_train_config
):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  cfg = tiny_train_config(tmp_path / "run", logging={"wandb": True})
  with pytest.raises(FlagError) as e:
    run(cfg, log=quiet)
  message = str(e.value)
  assert message.startswith("--logging.wandb: needs the wandb package") and "\n" not in message
  assert "pip install wandb" in message and "jetrl[wandb]" in message
  assert not os.path.exists(cfg.workdir)  # refused before the workdir was taken


def test_a_damaged_run_id_file_is_refused(tmp_path):
  """<workdir>/wandb_id is read back on a resume; what it holds goes to wandb.init only if it
  is a run id (lowercase letters and digits)."""
  from jetrl.train.writers import WandB

  sink = WandB(str(tmp_path), {}, mode="offline")
  (tmp_path / "wandb_id").write_text("../../etc/x; rm -rf /\n")
  with pytest.raises(ValueError, match="not a W&B run id"):
    sink.run_id()
  (tmp_path / "wandb_id").write_text("abc123\n")
  assert sink.run_id() == "abc123"
  (tmp_path / "wandb_id").unlink()
  new = sink.run_id()
  assert new.isalnum() and len(new) == 8 and (tmp_path / "wandb_id").read_text().strip() == new
