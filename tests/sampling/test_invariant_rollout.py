"""`jet_exact` traced for a GPU and run here (Pallas interpret mode): its plan's invariant blocks
(fixed-tile FP8 and bf16 GEMMs, kernels/invariant_gemm.py; attention in fixed key blocks from
each row's first token over a plain cache read in place, kernels/invariant_attention.py; the
norms one program a row, kernels/invariant_norm.py; the exact log-softmax) give the sampler's recorded log-probs equal to the training forward's bit for
bit: on the rollout's batch (6 rows, prompts of 5 to 8 tokens left-padded to 16) and on each
row alone, moved right by another left padding in a row of another width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.data import char_tokenizer, get_task
from jetrl.kernels import Device, resolve_plan
from jetrl.models import token_logprobs
from jetrl.precision import get_recipe
from jetrl.rl import make_train_batch, policy_logprobs
from jetrl.sampling import SamplingConfig, sample
from jetrl.train import pieces
from jetrl.train.config import ModelSpec

EXACT = get_recipe("jet_exact")
GPU = Device("gpu", interpret=True)  # a GPU's programs, run here with their kernels interpreted
TRAIN = resolve_plan(EXACT.train, GPU)
TOK = char_tokenizer()
IDS = pieces.token_ids(TOK)
TEMPERATURE = 0.8
SC = SamplingConfig(
  max_new_tokens=12, temperature=TEMPERATURE, n=2, stop_ids=(IDS.eos,), pad_id=IDS.pad,
  prompt_len=16,
)  # fmt: skip
WIDTH = 40  # a row alone: prompt + completion, moved right by a random left padding


@pytest.fixture(scope="module")
def run():
  cfg, params = pieces.make_model(ModelSpec("tiny", 2), TOK, 0, 64)
  params = jax.tree_util.tree_map(lambda a: a * 3.0 if a.ndim >= 2 else a, params)
  problems = [get_task("addition", difficulty=1, length=n, seed=0).batch("test", 0, 1)[0]
              for n in (1, 2, 3)]  # fmt: skip
  prompts = [pieces.encode_prompt(TOK, p.prompt) for p in problems]
  out = sample(params, cfg, prompts, jax.random.PRNGKey(0), SC, EXACT.rollout, kernels=GPU)
  return cfg, params, jax.tree_util.tree_map(np.asarray, out)


def test_jet_exact_on_a_gpu_plans_the_invariant_blocks():
  gpu = resolve_plan(EXACT.train, Device("gpu", "9.0", compiling=True)).blocks
  assert set(vars(gpu).values()) == {"invariant"}
  cpu = resolve_plan(EXACT.train, Device("cpu")).blocks
  assert set(vars(cpu).values()) == {"exact"}
  jet = resolve_plan(get_recipe("jet").train, Device("gpu", "9.0", compiling=True)).blocks
  assert "invariant" not in vars(jet).values()


def test_the_programs_hold_the_invariant_kernels(run):
  cfg, params, _ = run
  tok = jnp.zeros((2, 8), jnp.int32)
  jaxpr = str(
    jax.make_jaxpr(lambda p: token_logprobs(p, cfg, tok, tok, precision=EXACT.train, plan=TRAIN))(
      params
    )
  )
  # a layer's q / k / v, o, gate, up and down GEMMs (the layers' scan: once), and the head
  assert jaxpr.count("name=fp8_blockwise_gemm") == 5
  assert jaxpr.count("name=bf16_invariant_gemm") == 1
  assert jaxpr.count("name=invariant_attention") == 1


def test_rollout_logprobs_equal_the_training_forward_bitwise(run):
  cfg, params, out = run
  m = out.mask
  assert m.sum() >= 30 and len(set(out.prompt_mask.sum(1))) == 3
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, m, out.logprobs, np.zeros(len(out.tokens))
  )
  static = ("model_config", "precision", "chunk_size", "plan")
  lp, _ = jax.jit(policy_logprobs, static_argnames=static)(
    params, model_config=cfg, batch=batch, precision=EXACT.train,
    temperature=np.float32(TEMPERATURE), chunk_size=16, plan=TRAIN,
  )  # fmt: skip
  assert np.abs(np.asarray(lp) - out.logprobs)[m].max() == 0.0

  one = jax.jit(token_logprobs, static_argnames=("config", "precision", "chunk_size", "plan"))
  rng = np.random.default_rng(0)
  for r in range(len(out.tokens)):
    n = int(out.lengths[r])
    seq = np.concatenate([out.prompt_tokens[r][out.prompt_mask[r]], out.tokens[r, :n]])
    pad = int(rng.integers(1, WIDTH - len(seq) + 1))
    row = np.full(WIDTH + 1, IDS.pad, np.int32)
    row[pad : pad + len(seq)] = seq
    mask = np.zeros(WIDTH + 1, bool)
    mask[pad : pad + len(seq)] = True
    pos = np.maximum(np.cumsum(mask) - 1, 0)
    lp1, _ = one(
      params, cfg, row[None, :-1], row[None, 1:], precision=EXACT.train,
      positions=pos[None, :-1], attention_mask=mask[None, :-1],
      temperature=np.float32(TEMPERATURE), chunk_size=64, plan=TRAIN,
    )  # fmt: skip
    got = np.asarray(lp1)[0, pad + len(seq) - n - 1 : pad + len(seq) - 1]
    np.testing.assert_array_equal(got, out.logprobs[r, :n], err_msg=f"row {r} alone")


def test_an_fp8_kv_cache_keeps_the_rollout_bitwise_on_a_gpu(run):
  """The FP8 cache under the invariant blocks: the decode step attends over the dequantized
  cache in place, the training forward over the same rounded keys and values."""
  cfg, params, _ = run
  kv8 = get_recipe("jet_exact", kv_cache="fp8")
  prompts = [pieces.encode_prompt(TOK, p) for p in ("12+34=", "5+6=")]
  sc = SamplingConfig(
    max_new_tokens=6, temperature=TEMPERATURE, stop_ids=(IDS.eos,), pad_id=IDS.pad, prompt_len=8
  )
  out = jax.tree_util.tree_map(
    np.asarray, sample(params, cfg, prompts, jax.random.PRNGKey(1), sc, kv8.rollout, kernels=GPU)
  )
  assert out.mask.sum() >= 6
  batch = make_train_batch(
    out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, out.logprobs, np.zeros(2)
  )
  lp, _ = policy_logprobs(
    params, model_config=cfg, batch=batch, precision=kv8.train,
    temperature=np.float32(TEMPERATURE), chunk_size=16, plan=resolve_plan(kv8.train, GPU),
  )  # fmt: skip
  assert np.abs(np.asarray(lp) - out.logprobs)[out.mask].max() == 0.0
  plain, _ = policy_logprobs(
    params, model_config=cfg, batch=batch, precision=EXACT.train,
    temperature=np.float32(TEMPERATURE), chunk_size=16, plan=TRAIN,
  )  # fmt: skip
  assert (
    np.abs(np.asarray(plain) - out.logprobs)[out.mask].max() > 0.0
  )  # the cache's rounding shows
