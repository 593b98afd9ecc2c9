"""The logging backends (`jetrl.train.sinks`) on one tiny run: W&B offline and MLflow to a
file store beside TensorBoard hold every metric, the config and a completions table of
distinct prompts, read back with the packages' own readers (W&B offline: its run files, as
test_wandb.py reads them); each says on the console where it writes; a resume continues the
same MLflow run and logs a redone step once."""

import json
import os
import re
import shutil
import sys

import pytest

from jetrl.config import FlagError
from jetrl.train import run
from jetrl.train.sinks import BACKENDS, Sinks
from jetrl.train.sinks.mlflow import flatten, metric_name
from jetrl.train.writers import read_jsonl

pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
from test_wandb import offline_runs, tensorboard_texts  # noqa: E402


def test_mlflow_metric_names_map_what_mlflow_refuses():
  assert metric_name("agree/kl_k3") == "agree/kl_k3"  # slashes are legal: kept
  assert metric_name("eval/pass@4") == "eval/pass_at_4"
  assert metric_name("|dlogp|") == "_dlogp_"
  assert metric_name("/a//../b:c") == "a/b_c"
  assert flatten({"a": {"b": 1, "c": "x"}, "d": None}) == {"a.b": "1", "a.c": "x", "d": "null"}


def test_every_backend_is_one_registry_entry():
  assert [b.name for b in BACKENDS] == ["tensorboard", "wandb", "mlflow"]
  # A sink without the optional methods is skipped for them.
  calls = []

  class Minimal:
    def scalars(self, step, values):
      calls.append(("scalars", step))

    def samples(self, step, records):
      calls.append(("samples", step))

    def close(self):
      calls.append("close")

  sinks = Sinks(Minimal(), None)
  sinks.config({"a": 1})
  sinks.artifacts(["x.png"])
  sinks.scalars(1, {"a": 1.0})
  sinks.close()
  assert calls == [("scalars", 1), "close"] and sinks.where() == []


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_train_config):
  """A 2-step run with W&B offline, MLflow and TensorBoard and a table every step, then resumed
  from checkpoint 1 to step 3 (step 2 redone): (workdir, console lines of each process)."""
  mp = pytest.MonkeyPatch()
  tmp = tmp_path_factory.mktemp("trackers")
  home = tmp / "wandb_home"
  for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    mp.setenv(name, str(home / name.lower()))
  mp.setenv("WANDB_MODE", "offline")
  mp.setenv("WANDB_SILENT", "true")
  mp.delenv("WANDB_API_KEY", raising=False)
  mp.delenv("MLFLOW_TRACKING_URI", raising=False)
  workdir = tmp / "run"
  logging = dict(
    wandb=True, mlflow=True, tensorboard=True, plots=True, samples_every=1, samples_rows=2
  )
  sampled = dict(every=None, size=4, temperature=1.0, samples=2, k=(1, 2))
  cfg = tiny_train_config(workdir, logging=logging, eval=sampled)
  first, second = [], []
  run(cfg, log=first.append)
  shutil.rmtree(workdir / "checkpoints" / "2")
  run(cfg.replace(steps=3), log=second.append)
  yield workdir, first, second
  mp.undo()


def test_each_tracker_says_where_it_writes(tracked):
  workdir, first, second = tracked
  for lines in (first, second):
    text = "\n".join(lines)
    assert f"tensorboard --logdir {workdir}/tb" in text
    assert f"wandb sync {workdir}/wandb/offline-run-*" in text
    uri = (workdir / "mlruns").as_uri()
    assert f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}" in text
    assert sum("mlflow ui" in line for line in lines) == 1
    line = [x for x in lines if x.startswith("  eval @ step") and "held-out" in x][0]
    assert re.search(r"pass@1 \S+ maj@1 \S+ pass@2 \S+ maj@2 \S+ on 4 held-out", line), line


def test_mlflow_holds_every_metric_once_the_config_and_the_tables(tracked):
  from mlflow.tracking import MlflowClient

  workdir, _, _ = tracked
  client = MlflowClient(tracking_uri=(workdir / "mlruns").as_uri())
  run_id = (workdir / "mlflow_run_id").read_text().strip()
  exp = client.get_experiment_by_name("jetrl")
  (found,) = client.search_runs([exp.experiment_id])
  assert found.info.run_id == run_id and found.info.run_name == "run"
  assert found.info.status == "FINISHED"

  metrics = read_jsonl(str(workdir / "metrics.jsonl"))
  assert [m["step"] for m in metrics] == [1, 2, 3]
  for key in metrics[0]:
    v = metrics[0][key]
    if key == "step" or not isinstance(v, (int, float)) or isinstance(v, bool):
      continue
    history = client.get_metric_history(run_id, metric_name(key))
    steps = [h.step for h in history]
    assert steps == sorted(set(steps)) == [1, 2, 3], (key, steps)  # step 2 logged once
    if not key.startswith(("time/", "tokens_per_s/")):  # redone bit-exactly but the clocks
      for m, h in zip(metrics, history):
        assert h.value == pytest.approx(m[key], rel=1e-6, abs=1e-12), key
  evals = read_jsonl(str(workdir / "eval.jsonl"))
  history = client.get_metric_history(run_id, "eval/accuracy")
  for e in evals:  # pass@k and maj@k of --eval.k, as every sink's metric names
    for key in ("pass_at_1", "maj_at_1", "pass_at_2", "maj_at_2"):
      (h,) = [h for h in client.get_metric_history(run_id, "eval/" + key) if h.step == e["step"]]
      assert h.value == e["eval_" + key]
  # The first run's end (step 2) was evaluated too, before its records past checkpoint 1 were
  # dropped: MLflow keeps what it was given, once a step.
  assert [h.step for h in history] == [0, 2, 3]
  assert {e["step"]: e["eval_accuracy"] for e in evals}.items() <= {
    h.step: h.value for h in history
  }.items()

  params = found.data.params
  assert params["recipe"] == "bf16" and params["logging.mlflow"] == "true"
  assert params["prompts_per_step"] == "2"
  config = json.loads(open(client.download_artifacts(run_id, "config.json", str(workdir))).read())
  assert config["steps"] == 3  # the resumed run's

  plots = sorted(os.listdir(workdir / "plots"))
  assert plots and [a.path for a in client.list_artifacts(run_id, "plots")] == [
    "plots/" + p for p in plots
  ]

  samples = read_jsonl(str(workdir / "samples.jsonl"))
  tables = [a.path for a in client.list_artifacts(run_id, "samples")]
  assert tables == [f"samples/step_{s:08d}.json" for s in (1, 2, 3)]
  path = client.download_artifacts(run_id, tables[1], str(workdir / "dl"))
  table = json.load(open(path))
  assert table["columns"] == [
    "step",
    "row",
    "prompt",
    "completion",
    "answer",
    "reward",
    "correct",
    "length",
    "abs_dlogp",
  ]
  step2 = [s for s in samples if s["step"] == 2]
  assert [r[:4] for r in table["data"]] == [
    [s["step"], s["row"], s["prompt"], s["completion"]] for s in step2
  ]


def test_the_completions_table_has_distinct_prompts_once_a_step(tracked):
  workdir, _, _ = tracked
  samples = read_jsonl(str(workdir / "samples.jsonl"))
  assert [(s["step"], s["row"]) for s in samples] == [
    (1, 0),
    (1, 2),
    (2, 0),
    (2, 2),
    (3, 0),
    (3, 2),
  ]
  for step in (1, 2, 3):
    rows = [s for s in samples if s["step"] == step]
    assert len({r["prompt"] for r in rows}) == 2
    for r in rows:
      assert isinstance(r["correct"], bool) and r["correct"] == (r["reward"] >= 1.0)
      assert r["abs_dlogp"] is None or 0 <= r["abs_dlogp"] < 1.0
      assert r["length"] == len(r["tokens"])
  # TensorBoard's text tab: one table a step, as TensorBoard reads the files (a resumed
  # file's session start drops the earlier file's events from its step on).
  from conftest import tensorboard_events
  from tensorboardX.proto.event_pb2 import SessionLog

  shown = []  # (step, text) as TensorBoard keeps them
  for event in tensorboard_events(workdir / "tb"):
    if event.HasField("session_log") and event.session_log.status == SessionLog.START:
      shown = [(step, t) for step, t in shown if step < event.step]
    shown += [(event.step, v) for v in event.summary.value if v.tag.startswith("samples")]
  assert [step for step, _ in shown] == [1, 2, 3]
  texts = tensorboard_texts(workdir / "tb")
  assert all(len(t.split("\n")) == 2 + 2 for t in texts.values())
  assert "correct" in texts[1].split("\n")[0] and "abs_dlogp" in texts[1].split("\n")[0]


def test_wandb_offline_holds_the_metrics_config_and_table(tracked):
  workdir, _, _ = tracked
  runs = offline_runs(workdir)
  assert len(runs) == 2 and runs[0]["config"]["logging"]["mlflow"] is True
  history = {**runs[1]["history"], **runs[0]["history"]}
  for m in read_jsonl(str(workdir / "metrics.jsonl")):
    assert history[m["step"]]["reward_mean"] == pytest.approx(m["reward_mean"], rel=1e-6)
  assert history[2]["samples/nrows"] == 2
  images = {k for row in runs[1]["history"].values() for k in row if k.startswith("plots/")}
  assert any(k.startswith("plots/reward") for k in images), sorted(images)


def test_a_missing_mlflow_package_is_one_line_before_the_run_starts(
  tmp_path, monkeypatch, tiny_train_config
):
  monkeypatch.setitem(sys.modules, "mlflow", None)
  cfg = tiny_train_config(tmp_path / "run", logging={"mlflow": True})
  with pytest.raises(FlagError) as e:
    run(cfg, log=print)
  message = str(e.value)
  assert message.startswith("--logging.mlflow: needs the mlflow package") and "\n" not in message
  assert "jetrl[mlflow]" in message
  assert not os.path.exists(cfg.workdir)


def test_the_mlflow_run_id_file_is_checked_and_a_stale_one_starts_a_new_run(tmp_path):
  from jetrl.train.sinks import MLflow

  sink = MLflow(str(tmp_path))
  (tmp_path / "mlflow_run_id").write_text("../../etc/x; rm -rf /\n")
  with pytest.raises(ValueError, match="not an MLflow run id"):
    sink.scalars(1, {"a": 1.0})
  (tmp_path / "mlflow_run_id").write_text("0123abcd\n")  # not in this store
  sink.scalars(1, {"a/b@2": 1.0})
  sink.close()
  new = (tmp_path / "mlflow_run_id").read_text().strip()
  assert new != "0123abcd"
  history = sink.client.get_metric_history(new, "a/b_at_2")
  assert [(h.step, h.value) for h in history] == [(1, 1.0)]
  assert "(look: open http://host:5000)" in MLflow(str(tmp_path), uri="http://host:5000").where()
