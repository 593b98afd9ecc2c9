"""experiments/mismatch_length.py at toy size: a 2-layer random Llama written as a Hugging Face
folder (with the character tokenizer and a chat template), one GSM8K-style question (in the
tokenizer's alphabet), two samples.

What could be wrong and is checked against values known by hand:
- jet_exact's rollout log-probs equal its training forward bit for bit, and its forward gives
  the same bits for a row alone as in the batch: every mismatch metric must be exactly 0;
- fp8_rollout scores FP8 rollouts with a bf16 training forward: its mismatch must exceed the
  bf16 forward's own floor;
- with --stop=false every row reaches the budget, so a prefix of L tokens counts rows x L tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import tiny_llama_config

from jetrl.data import char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = (
  "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
  "{% if add_generation_prompt %}a:{% endif %}"
)


def model_folder(path):
  import torch
  import transformers

  tok = char_tokenizer()
  torch.manual_seed(0)
  cfg = tiny_llama_config(tok.vocab_size, eos_token_id=2, pad_token_id=0)
  transformers.LlamaForCausalLM(cfg).save_pretrained(path)
  tok.save(path)
  # The chat instruction has characters outside the alphabet: read them as the pad id.
  spec = json.loads((path / "tokenizer.json").read_text())
  spec["model"]["unk_token"] = "<|pad|>"
  (path / "tokenizer.json").write_text(json.dumps(spec))
  (path / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "chat_template": TEMPLATE,
      }
    )
  )
  return str(path)


@pytest.mark.slow
def test_mismatch_length_at_toy_size(tmp_path):
  folder = model_folder(tmp_path / "model")
  questions = tmp_path / "questions.jsonl"
  questions.write_text(json.dumps({"question": "tom has 3 apples and buys 4 more. how many?"}))
  out = tmp_path / "mismatch.json"
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), JAX_PLATFORMS="cpu")
  res = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "mismatch_length.py"),
      f"--model.name={folder}",
      f"--gsm8k={questions}",
      "--prompts=1",
      "--sampling.n=2",
      "--lengths=4,12",
      "--recipes=jet_exact,fp8_rollout",
      f"--json_out={out}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert "| jet_exact | 12 |" in res.stdout  # the printed table has a row per recipe and length
  got = {r["recipe"]: r for r in json.loads(out.read_text())["results"]}
  assert set(got) == {"jet_exact", "fp8_rollout"}
  for name, r in got.items():
    assert r["rows"] == 2
    for L in (4, 12):
      for kind in ("rollout_vs_train", "floor"):
        assert r["by_length"][str(L)][kind]["n_tokens"] == 2 * L, (name, L, kind)
  for L in ("4", "12"):
    for kind in ("rollout_vs_train", "floor"):
      m = got["jet_exact"]["by_length"][L][kind]
      assert m["abs_diff_max"] == 0 and m["seq_abs_sum_mean"] == 0 and m["kl_k3"] == 0, (L, m)
  fp8 = got["fp8_rollout"]["by_length"]["12"]
  assert fp8["rollout_vs_train"]["abs_diff_mean"] > fp8["floor"]["abs_diff_mean"]
  assert fp8["rollout_vs_train"]["abs_diff_mean"] > 1e-4
