"""A LoRA RL run end to end (`--lora.rank`): checkpoints hold the adapters alone, a run killed
after a step and resumed ends with the uninterrupted run's adapters and records bit for bit,
the merged export loads in `transformers` with the adapted model's logits, and the flags that
cannot work with LoRA are refused by name."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from conftest import quiet
from jetrl.config import ConfigError, FlagError
from jetrl.data import Problem, Task
from jetrl.models import forward, init_params
from jetrl.models.io.hf_io import load_pretrained
from jetrl.models.lora import LoraConfig, attach
from jetrl.precision import get_recipe
from jetrl.train import pieces, run
from jetrl.train.checkpoint import read_params
from jetrl.train.export import ExportConfig, export_run

LORA = {"rank": 4, "alpha": 8.0, "targets": ("q", "v", "down")}


class Parity(Task):
  """Prompts `say N`; reward 1 for a completion of odd length: rewards differ within groups."""

  name = "parity"

  def __init__(self):
    self.seed = 0

  def problem(self, split, index):
    return Problem(prompt=f"say {index % 10}\n", answer="1", solution="1")

  def reward(self, prompts, completions, answers):
    return [float(len(c) % 2) for c in completions]


def records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [
    {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s/"))} for r in rows
  ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_train_config):
  root = tmp_path_factory.mktemp("lora")
  make = lambda name, **kw: tiny_train_config(root / name, recipe="jet", lora=LORA, **kw)
  straight = make("straight")
  run(straight, task=Parity(), log=quiet)
  resumed = make("resumed", steps=1)
  run(resumed, task=Parity(), log=quiet)
  run(resumed.replace(steps=2), task=Parity(), log=quiet)
  return straight, resumed


def test_checkpoint_holds_the_adapters_and_a_resume_is_exact(runs):
  straight, resumed = runs
  a, meta = read_params(straight.workdir, log=quiet)
  b, _ = read_params(resumed.workdir, log=quiet)
  assert meta["step"] == 2 and sorted(a) == ["w_down", "wq", "wv"]
  assert a["wq"]["a"].shape[-1] == 4 and np.any(np.asarray(a["wq"]["b"]))  # trained: b != 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
  got = records(resumed.workdir)
  assert got == records(straight.workdir) and got[0]["flat_groups"] < 1.0


def test_merged_export_loads_in_transformers_with_the_adapted_logits(runs, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  straight, _ = runs
  out = export_run(ExportConfig(workdir=straight.workdir, out=str(tmp_path / "hf")), log=quiet)
  adapters, _ = read_params(straight.workdir, log=quiet)
  cfg, _ = load_pretrained(out)
  base = init_params(cfg, jax.random.PRNGKey(straight.seed))  # the run's random base
  tokens = [[5, 9, 12, 3, 7, 20]]
  want = np.asarray(
    forward(
      attach(base, adapters, LoraConfig(**LORA)),
      cfg,
      np.asarray(tokens),
      precision=get_recipe("fp32").train,
    )
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    got = model(torch.tensor(tokens)).logits.numpy()
  assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
  peft_out = export_run(
    ExportConfig(workdir=straight.workdir, out=str(tmp_path / "adapter"), adapter=True), log=quiet
  )
  assert sorted(os.listdir(peft_out)) == [
    ".jetrl-export.json",
    "adapter_config.json",
    "adapter_model.safetensors",
  ]


def test_lora_refusals(runs, tiny_train_config, tmp_path):
  straight, _ = runs
  with pytest.raises(FlagError, match="--init_from: the run in .* trained LoRA adapters"):
    run(tiny_train_config(tmp_path / "a", init_from=straight.workdir), log=quiet)
  with pytest.raises(FlagError, match="--lora.rank: LoRA runs on one device"):
    run(tiny_train_config(tmp_path / "b", lora=LORA, mesh="data:1"), log=quiet)
  with pytest.raises(ConfigError, match="lora.targets: 'attn' is not accepted"):
    tiny_train_config(tmp_path / "c", lora={"rank": 4, "targets": ("q", "attn")})


def test_lora_on_a_mixture_of_experts_is_refused_by_name(tiny_train_config, tmp_path, monkeypatch):
  """Refused with the model's config, before any weight is made."""
  real = pieces.model_config

  def moe_config(*args):
    c = real(*args)
    return dataclasses.replace(
      c, family="qwen3_moe", qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=32
    )

  monkeypatch.setattr(pieces, "model_config", moe_config)
  monkeypatch.setattr(pieces, "make_params", lambda *a: pytest.fail("made the weights"))
  with pytest.raises(FlagError, match=r"--lora.rank: LoRA .* is a mixture of experts"):
    run(tiny_train_config(tmp_path, lora=LORA), log=quiet)
