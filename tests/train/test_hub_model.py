"""`--model.name=org/name`: a Hugging Face hub id resolves to its snapshot in the local hub
cache (HF_HUB_CACHE, HF_HOME), without the network, here a cache built in the test in the
hub's layout (models--org--name/snapshots/<commit>/, refs/main) around a model `transformers`
wrote; a run trains from it on a JSON-lines file of its own (`--task.name=jsonl`). A hub id
that is not cached, offline, is refused naming the cache and how to fetch it; presets say they
are random weights."""

from __future__ import annotations

import json
import os

import pytest

from conftest import parse_flags
from jetrl.config import FlagError
from jetrl.models.io.hub import hub_cache
from jetrl.train import pieces, run
from jetrl.train.validation import check_model

pytest.importorskip("transformers")
from test_hf_folder_run import write_model, write_tokenizer  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """A hub cache holding org/tiny-chat: (cache folder, snapshot folder)."""
  cache = tmp_path_factory.mktemp("hub")
  repo = cache / "models--org--tiny-chat"
  snapshot = repo / "snapshots" / COMMIT
  snapshot.mkdir(parents=True)
  write_model(snapshot, write_tokenizer(snapshot), 0)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  return str(cache), str(snapshot)


def test_the_cache_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
  for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  assert hub_cache() == str(tmp_path / ".cache" / "huggingface" / "hub")
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  assert hub_cache() == str(tmp_path / "hf" / "hub")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
  assert hub_cache() == str(tmp_path / "c")


def test_a_hub_id_not_in_the_cache_is_refused_offline(hub, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", hub[0])
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(FlagError) as e:
    check_model("org/absent")
  assert str(e.value).startswith(
    f"--model.name: 'org/absent' is not in the Hugging Face cache {hub[0]}"
  )
  assert "huggingface-cli download org/absent" in str(e.value)
  with pytest.raises(FlagError, match=r"is none of the presets .*RANDOM weights.*hub id"):
    check_model("no-such-preset")


def test_a_run_trains_a_hub_id_from_the_cache_on_a_jsonl_file(hub, monkeypatch, tmp_path):
  monkeypatch.setenv("HF_HUB_CACHE", hub[0])
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # cached: no download is tried
  import huggingface_hub

  real = huggingface_hub.snapshot_download

  def cache_only(*args, **kwargs):
    assert kwargs.get("local_files_only"), "tried the network"
    return real(*args, **kwargs)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
  data = tmp_path / "mine.jsonl"
  data.write_text("".join(json.dumps({"q": f"{a}+{a}", "sum": 2 * a}) + "\n" for a in range(10)))
  cfg = parse_flags(
    [
      f"--workdir={tmp_path / 'run'}",
      "--model.name=org/tiny-chat",
      "--task.name=jsonl",
      f"--task.data_path={data}",
      "--task.prompt_field=q",
      "--task.answer_field=sum",
      "--task.checker=number",
      "--recipe=bf16",
      "--steps=1",
      "--prompts_per_step=2",
      "--sampling.n=2",
      "--sampling.max_new_tokens=8",
      "--eval.size=2",
      "--eval.every=none",
      "--logging.tensorboard=false",
      "--logging.plots=false",
    ]
  )
  assert pieces.model_folder(cfg.model) == hub[1]
  lines = []
  run(cfg, log=lines.append)
  assert lines[0].startswith(f"jetrl RL: recipe=bf16 model=org/tiny-chat (hub cache: {hub[1]})")
  assert "task=jsonl" in lines[0]
  records = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1]
  saved = json.load(open(tmp_path / "run" / "config.json"))
  assert saved["model"]["name"] == "org/tiny-chat" and saved["task"]["answer_field"] == "sum"
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "1")
  # The export finds the snapshot's own generation config (written by transformers, which
  # records its version there; without it, only bos / pad / eos ids would be written).
  from jetrl.train.export import ExportConfig, export_run

  out = export_run(ExportConfig(workdir=str(tmp_path / "run"), out=str(tmp_path / "hf")), log=len)
  gen = json.load(open(os.path.join(out, "generation_config.json")))
  assert "transformers_version" in gen and sorted(gen["eos_token_id"]) == [0, 2]


def test_the_help_lists_every_preset_as_random_weights_and_every_task():
  from jetrl.data.registry import TASKS
  from jetrl.models import PRESETS
  from jetrl.train import ModelSpec, TrainConfig
  from jetrl.train.cli import usage

  text = " ".join(usage(TrainConfig(), "").split())
  name_help = ModelSpec.__dataclass_fields__["name"].metadata["help"]  # unwrapped
  assert "(RANDOM weights in that model's shape, not the trained model)" in name_help
  for name in PRESETS:
    assert f" {name}," in name_help or f" {name} (" in name_help, name
  assert "--task.name=addition" in text
  task_help = text[text.index("--task.name=") : text.index("--task.difficulty=")]
  for name in (*TASKS, "addition", "multiplication", "sorting", "chat_arithmetic", "jsonl"):
    assert name in task_help, name
  first = pieces.describe_model(ModelSpec(name="qwen2.5-0.5b"))
  assert first == (
    "qwen2.5-0.5b (preset: RANDOM weights, the shape of qwen2.5-0.5b only; not a trained model)"
  )
