"""export_hf: what it refuses (NaN, a foreign folder, a tokenizer that does not fit), casting,
the tokenizer and generation config it carries, and the atomic replace."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import models as M
from jetrl.sampling import SamplingConfig, sample
from model_helpers import hf_logits, rel_err, tiny_config

CONFIG = tiny_config("llama", vocab=40, d_model=32, heads=(2, 1, 16), d_ff=48)


def _tokenizer_folder(path, eos_ids=None):
  tokenizers = pytest.importorskip("tokenizers")
  words = ["[UNK]", "a", "b", "c"]
  backend = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens(["<|end|>", "<|stop|>"])
  os.makedirs(path, exist_ok=True)
  backend.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end|>",
        "chat_template": "{{ messages[0]['content'] }}",
      },
      f,
    )
  if eos_ids is not None:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": eos_ids}, f)
  return str(path)


@pytest.fixture(scope="module")
def params():
  return M.init_params(CONFIG, jax.random.PRNGKey(0))


def test_export_loads_and_generates(params, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  tok_dir = _tokenizer_folder(tmp_path / "tok", eos_ids=[4, 5])
  out = M.export_hf(params, CONFIG, str(tmp_path / "out"), tokenizer_from=tok_dir, dtype="bfloat16")
  assert sorted(os.listdir(tmp_path)) == ["out", "tok"]  # no temporary folder left
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert model.dtype == torch.bfloat16 and list(model.generation_config.eos_token_id) == [4, 5]
  assert transformers.AutoTokenizer.from_pretrained(out).chat_template is not None
  tokens = np.array([[1, 2, 3, 1]])
  want = hf_logits(model.float(), tokens)
  bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
  got = M.forward(
    jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), bf16), CONFIG, jnp.asarray(tokens)
  )
  assert rel_err(got, want) < 1e-4
  # Greedy decoding: transformers on the exported folder, jetrl on the same (bf16-rounded)
  # params in float32, both stopping on the folder's eos ids.
  stop = M.stop_ids(M.load_model_tokenizer(out))
  assert stop == (4, 5)
  prompts = [[1, 2, 3, 1], [3, 3, 2], [2]]
  sc = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_ids=stop, pad_id=0)
  ours = sample(
    jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), bf16),
    CONFIG,
    prompts,
    jax.random.PRNGKey(0),
    sc,
  )
  for i, p in enumerate(prompts):
    with torch.no_grad():
      want = model.generate(
        torch.tensor([p]),
        max_new_tokens=8,
        do_sample=False,
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
      )[0, len(p) :].tolist()
    got = np.asarray(ours.tokens[i])[: int(ours.lengths[i])].tolist()
    assert got == want, f"prompt {p}: {got} != {want}"


def test_generation_config_written_when_missing(params, tmp_path):
  tok_dir = _tokenizer_folder(tmp_path / "tok")
  out = M.export_hf(params, CONFIG, str(tmp_path / "out"), tokenizer_from=tok_dir)
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {"eos_token_id": [4]}
  modes = {n: os.stat(os.path.join(out, n)).st_mode & 0o777 for n in os.listdir(out)}
  assert len(set(modes.values())) == 1, modes  # the weights as readable as the other files
  assert M.stop_ids(M.load_model_tokenizer(out)) == (4,)


def test_refusals(params, tmp_path):
  out = tmp_path / "out"
  bad = dict(params, final_norm=params["final_norm"].at[3].set(jnp.nan))
  with pytest.raises(ValueError, match=r"params\['final_norm'\] holds 1 non-finite values"):
    M.export_hf(bad, CONFIG, str(out))
  assert not out.exists()
  with pytest.raises(ValueError, match="dtype 'int8' is not accepted"):
    M.export_hf(params, CONFIG, str(out), dtype="int8")
  small = dataclasses.replace(CONFIG, vocab_size=4)
  with pytest.raises(ValueError, match="does not fit the model: tokenizer size - 1 5"):
    M.export_hf(
      M.init_params(small, jax.random.PRNGKey(1)),
      small,
      str(out),
      tokenizer_from=_tokenizer_folder(tmp_path / "tok"),
    )
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="exists and is not empty"):
    M.export_hf(params, CONFIG, str(out))
  assert (out / "notes.txt").read_text() == "mine"
  # overwrite replaces only a folder an earlier export wrote, holding nothing else.
  with pytest.raises(ValueError, match=r"was not written by an export \(no \.jetrl-export"):
    M.export_hf(params, CONFIG, str(out), overwrite=True)
  assert sorted(os.listdir(out)) == ["notes.txt"]
  (out / "notes.txt").unlink()
  M.export_hf(params, CONFIG, str(out))
  M.export_hf(params, CONFIG, str(out), overwrite=True)
  assert sorted(os.listdir(out)) == [".jetrl-export.json", "config.json", "model.safetensors"]
  assert json.loads((out / ".jetrl-export.json").read_text())["files"] == [
    "config.json",
    "model.safetensors",
  ]
  _, again = M.load_pretrained(str(out))
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)


def test_overwrite_never_deletes_what_the_export_did_not_write(params, tmp_path):
  """An export's folder with a file added, a forged marker, or a run's folder: refused, each
  file left as it was (`--overwrite` once deleted a whole run's workdir)."""
  out = tmp_path / "out"
  M.export_hf(params, CONFIG, str(out))
  (out / "notes.txt").write_text("mine")
  (out / "runs").mkdir()
  with pytest.raises(
    ValueError, match=r"holds files the earlier export did not write: \['notes.txt', 'runs'\]"
  ):
    M.export_hf(params, CONFIG, str(out), overwrite=True)
  assert (out / "notes.txt").read_text() == "mine" and (out / "runs").is_dir()
  run = tmp_path / "run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / ".jetrl-export.json").write_text("not json")
  with pytest.raises(ValueError, match="was not written by an export"):
    M.export_hf(params, CONFIG, str(run), overwrite=True)
  assert (run / "checkpoints" / "2").is_dir()
  link = tmp_path / "link"
  os.symlink(out, link)
  with pytest.raises(ValueError, match="is a symbolic link"):
    M.export_hf(params, CONFIG, str(link), overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["link", "out", "run"]  # no temporary folder left
