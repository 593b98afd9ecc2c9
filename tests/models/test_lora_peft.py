"""LoRA export both ways, against `transformers` + `peft` on a random 2-layer Llama written by
transformers: the PEFT adapter folder loads onto the base with jetrl's logits, and the merged
folder loads in transformers alone with the same logits."""

import json

import jax
import numpy as np
import pytest

from conftest import one_torch_thread, tiny_llama_config
from jetrl.models import forward
from jetrl.models.io.export import export_hf
from jetrl.models.io.hf_io import load_pretrained
from jetrl.models.lora import LoraConfig, attach, init_adapters, merge
from jetrl.models.io.lora_export import export_peft
from jetrl.precision import get_recipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=12.0, targets=("q", "v", "o", "up", "down"))
TOKENS = [[1, 5, 9, 2, 7, 30, 11, 4]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  torch.manual_seed(0)
  with one_torch_thread():
    model = transformers.LlamaForCausalLM(tiny_llama_config(48)).eval()
    model.save_pretrained(path)
  cfg, params = load_pretrained(str(path))
  keys = iter(jax.random.split(jax.random.PRNGKey(7), 32))
  adapters = jax.tree_util.tree_map(
    lambda a: a + 0.1 * jax.random.normal(next(keys), a.shape),
    init_adapters(cfg, LORA, jax.random.PRNGKey(3)),
  )
  want = np.asarray(
    forward(
      attach(params, adapters, LORA), cfg, np.asarray(TOKENS), precision=get_recipe("fp32").train
    )
  )
  return str(path), cfg, params, adapters, want


def logits(model):
  with one_torch_thread(), torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


def test_peft_loads_the_adapters_with_jetrls_logits(base, tmp_path):
  path, cfg, _, adapters, want = base
  out = export_peft(adapters, cfg, LORA, str(tmp_path / "adapter"), base_model=path)
  with open(f"{out}/adapter_config.json") as f:
    meta = json.load(f)
  assert meta["r"] == 4 and meta["lora_alpha"] == 12.0
  assert sorted(meta["target_modules"]) == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
  with one_torch_thread():
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    plain = logits(hf)
    model = peft.PeftModel.from_pretrained(hf, out).eval()
  got = logits(model)
  scale = np.max(np.abs(want))
  assert np.max(np.abs(plain - want)) > 1e-2 * scale  # the adapters change the logits
  assert np.max(np.abs(got - want)) <= 1e-5 * scale
  with pytest.raises(ValueError, match="exists and is not empty"):
    export_peft(adapters, cfg, LORA, out)


def test_merged_folder_loads_in_transformers_with_jetrls_logits(base, tmp_path):
  path, cfg, params, adapters, want = base
  out = export_hf(merge(params, adapters, LORA), cfg, str(tmp_path / "merged"))
  with one_torch_thread():
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
  assert np.max(np.abs(logits(hf) - want)) <= 1e-5 * np.max(np.abs(want))
