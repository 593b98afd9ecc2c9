"""`jet_exact`: the sampler's recorded log-probs equal the training forward's bit for bit.

Compared with max |delta| == 0.0 on a random and on a briefly SFT-trained tiny model, against
`token_logprobs` on the rollout batch, on every row alone with another left padding, and in
the update step's pre-update forward of a short RL run; varied: batch size, samples per
prompt, prompt lengths and padding, temperature (greedy too), log-prob chunk size, position
in the sequence, and a batch large enough (24 rows) for XLA:CPU to run the training forward's
query / key norms through YNNPACK while the sampler's small decode steps stay in XLA's own code.
`jet`, the same comparison, is close but not exact. With an FP8 KV cache (`kv_cache="fp8"`)
the rollout reads E4M3 keys and values and the training forward the same rounded values: the
same comparisons, with the same results. (Host devices of a data mesh:
tests/parallel/_multi_device_cases.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.data import char_tokenizer, get_task
from jetrl.models import token_logprobs
from jetrl.precision import get_recipe
from jetrl.rl import (
  OptimizerConfig,
  UpdateConfig,
  group_advantages,
  init_train_state,
  make_train_batch,
  make_optimizer,
  policy_logprobs,
  update_step,
)
from jetrl.sampling import SamplingConfig, sample
from jetrl.train import pieces, scoring
from jetrl.train.config import ModelSpec
from jetrl.train.sft import _solution_batch, sft_step

EXACT, JET = get_recipe("jet_exact"), get_recipe("jet")
EXACT8, JET8 = get_recipe("jet_exact", kv_cache="fp8"), get_recipe("jet", kv_cache="fp8")
TOK = char_tokenizer()
IDS = pieces.token_ids(TOK)
TASK = get_task("addition", difficulty=1, length=2, seed=0)
MAX_NEW = 40
WIDTH = 63  # inputs of a re-padded row: any prompt + completion here fits
# A: 4 prompts x 2 samples, temperature 0.8. B: 8 prompts of 5, 7 and 9 tokens x 1 sample,
# greedy. Both 8 rows of prompt width 16 (one compiled training forward for both).
SC_A = SamplingConfig(
  max_new_tokens=MAX_NEW, temperature=0.8, n=2, stop_ids=(IDS.eos,), pad_id=IDS.pad, prompt_len=16
)
SC_B = SamplingConfig(
  max_new_tokens=MAX_NEW, temperature=0.0, n=1, stop_ids=(IDS.eos,), pad_id=IDS.pad, prompt_len=16
)

# Temperature is traced: one compiled training forward serves every temperature.
_lp = jax.jit(
  policy_logprobs,
  static_argnames=("model_config", "precision", "chunk_size", "top_k", "top_p"),
)
_lp_row = jax.jit(token_logprobs, static_argnames=("config", "precision", "chunk_size"))


def _train_logprobs(params, cfg, out, recipe, temperature):
  """The training forward's log-probs of a rollout's rows, in chunks of 16 positions."""
  lp, _ = _lp(
    params,
    model_config=cfg,
    batch=_batch(out),
    precision=recipe.train,
    temperature=np.float32(temperature),
    chunk_size=16,
  )
  return np.asarray(lp)


def _prompts(which):
  if which == "A":
    return TASK.batch("train", 0, 4)
  if which == "C":  # 12 x 2 = 24 rows: 24 x 56 tokens x 4 heads >= 4096 query norms
    return TASK.batch("train", 4, 12)
  return [
    get_task("addition", difficulty=1, length=n, seed=0).batch("test", i, 1)[0]
    for i, n in enumerate((1, 3, 2, 3, 1, 2, 2, 3))
  ]


@pytest.fixture(scope="module")
def model():
  cfg, params = pieces.make_model(ModelSpec("tiny", 2), TOK, 0, 64)
  # Sharpen the random model a little so sampled tokens are not uniform noise.
  return cfg, jax.tree_util.tree_map(lambda a: a * 3.0 if a.ndim >= 2 else a, params)


@pytest.fixture(scope="module")
def sft_params(model):
  """The random model after 30 supervised steps on gold solutions (bf16)."""
  cfg, params = model
  opt = OptimizerConfig(lr=3e-3, max_grad_norm=1e6)
  params = jax.tree_util.tree_map(jnp.array, params)
  state, losses = make_optimizer(opt, 30).init(params), []
  for step in range(30):
    batch = _solution_batch(TOK, TASK.batch("train", 100 + 16 * step, 16), 16, MAX_NEW)
    params, state, loss, _, ok, _ = sft_step(
      params,
      state,
      batch,
      model_config=cfg,
      precision=get_recipe("bf16").train,
      optimizer=opt,
      total_steps=30,
    )
    assert bool(ok)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  return params


def _rollout(cfg, params, which, recipe, seed=0):
  problems = _prompts(which)
  prompts = [pieces.encode_prompt(TOK, p.prompt) for p in problems]
  sc = SC_B if which == "B" else SC_A
  out = sample(params, cfg, prompts, jax.random.PRNGKey(seed), sc, recipe.rollout)
  return problems, sc, jax.tree_util.tree_map(np.asarray, out)


def _batch(out, adv=None):
  return make_train_batch(
    out.prompt_tokens,
    out.prompt_mask,
    out.tokens,
    out.mask,
    out.logprobs,
    np.zeros(len(out.tokens)) if adv is None else adv,
  )


def _diffs(cfg, params, out, temperature, recipe):
  """max |rollout - training forward| over the generated tokens: on the whole batch (chunks
  of 16 positions), and each row alone, shifted right by a random padding, one 64 chunk."""
  m = out.mask
  lp = _train_logprobs(params, cfg, out, recipe, temperature)
  whole = np.abs(lp - out.logprobs)[m].max()
  rng = np.random.default_rng(0)
  alone = 0.0
  for r in range(len(out.tokens)):
    n = int(out.lengths[r])
    seq = np.concatenate([out.prompt_tokens[r][out.prompt_mask[r]], out.tokens[r, :n]])
    pad = int(rng.integers(0, WIDTH + 1 - len(seq) + 1))
    row = np.full(WIDTH + 1, IDS.pad, np.int32)
    row[pad : pad + len(seq)] = seq
    mask = np.zeros(WIDTH + 1, bool)
    mask[pad : pad + len(seq)] = True
    pos = np.maximum(np.cumsum(mask) - 1, 0)
    lp1, _ = _lp_row(
      params,
      cfg,
      row[None, :-1],
      row[None, 1:],
      precision=recipe.train,
      positions=pos[None, :-1],
      attention_mask=mask[None, :-1],
      temperature=temperature,
      chunk_size=64,
    )
    got = np.asarray(lp1)[0, pad + len(seq) - n - 1 : pad + len(seq) - 1]
    alone = max(alone, float(np.abs(got - out.logprobs[r, :n]).max()))
  return float(whole), alone


@pytest.mark.parametrize("which", ["A", "B"])
@pytest.mark.parametrize("trained", [False, True], ids=["random", "sft"])
def test_rollout_logprobs_equal_the_training_forward_bitwise(model, sft_params, which, trained):
  cfg, params = model
  params = sft_params if trained else params
  _, sc, out = _rollout(cfg, params, which, EXACT)
  assert out.mask.sum() >= 40
  whole, alone = _diffs(cfg, params, out, np.float32(sc.temperature or 1.0), EXACT)
  assert whole == 0.0 and alone == 0.0, (whole, alone)


@pytest.mark.parametrize("which", ["A", "B"])
def test_fp8_kv_cache_rollout_logprobs_equal_the_training_forward_bitwise(model, which):
  """The rollout's cache holds E4M3 keys and values; the training forward's attention reads
  them quantized and dequantized alike: bit for bit still. Its rounding is real: jet_exact's
  training forward without it does not give the FP8 cache's rollout log-probs."""
  cfg, params = model
  _, sc, out = _rollout(cfg, params, which, EXACT8)
  assert out.mask.sum() >= 40
  temperature = np.float32(sc.temperature or 1.0)
  whole, alone = _diffs(cfg, params, out, temperature, EXACT8)
  assert whole == 0.0 and alone == 0.0, (whole, alone)
  plain = _train_logprobs(params, cfg, out, EXACT, temperature)
  assert np.abs(plain - out.logprobs)[out.mask].max() > 1e-3


def test_decode_in_segments_changes_no_bit(model, monkeypatch):
  """A long budget decodes in segments whose attention reads only the cache's filled part
  (`decode_segments`); forced here at 40 tokens: the same rollout, bit for bit."""
  from jetrl.sampling import sampler

  cfg, params = model
  _, _, whole = _rollout(cfg, params, "A", EXACT)
  monkeypatch.setattr(sampler, "SEGMENT_MIN_TOKENS", 8)
  assert sampler.decode_segments(MAX_NEW) == (10, 20, 40)
  _, sc, parts = _rollout(cfg, params, "A", EXACT)
  assert parts.mask.sum() >= 40 and parts.lengths.max() > 20  # reaches the last segment
  for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(parts)):
    np.testing.assert_array_equal(a, b)
  lp = _train_logprobs(params, cfg, parts, EXACT, sc.temperature)
  assert np.abs(lp - parts.logprobs)[parts.mask].max() == 0.0


@pytest.mark.slow
def test_rollout_logprobs_equal_the_training_forward_bitwise_in_a_large_batch(model):
  """24 rows: XLA:CPU hands the training forward's RMSNorm fusions of >= 4096 vectors to
  YNNPACK, whose rsqrt rounds differently from XLA's; the decode steps and the rows alone stay
  below that size. The exact RMSNorm's rsqrt (`exact_ops.rsqrt32`) is the same in both."""
  cfg, params = model
  _, sc, out = _rollout(cfg, params, "C", EXACT)
  assert len(out.tokens) == 24 and out.mask.sum() >= 200
  whole, alone = _diffs(cfg, params, out, np.float32(sc.temperature), EXACT)
  assert whole == 0.0 and alone == 0.0, (whole, alone)


@pytest.mark.parametrize("recipe", [JET, JET8], ids=["jet", "jet_fp8_kv_cache"])
def test_jet_is_close_but_not_bitwise(model, recipe):
  cfg, params = model
  _, sc, out = _rollout(cfg, params, "A", recipe)
  lp = _train_logprobs(params, cfg, out, recipe, sc.temperature)
  d = np.abs(lp - out.logprobs)[out.mask]
  print(f"{recipe.rollout.kv_cache} cache: max |dlogp| {d.max():.3g}, mean {d.mean():.3g}")
  assert 0.0 < d.max() < 1.0 and d.mean() < 0.05


@pytest.mark.parametrize("recipe", [EXACT, EXACT8], ids=["jet_exact", "jet_exact_fp8_kv_cache"])
def test_short_rl_run_logs_zero_mismatch_at_every_step(model, sft_params, recipe):
  """Sample, reward, update (the pre-update forward in micro-batches of half the rows), three
  times: the agreement metrics are exactly zero and the first PPO ratio exactly one (with an
  FP8 KV cache too: its gradient passes straight through the rounding)."""
  cfg, _ = model
  # The rollout's log-probs as the PPO ratio's old policy: the first ratio compares them with
  # the training forward (with "recompute" it would compare the forward with itself).
  ucfg = UpdateConfig(loss="grpo", micro_batches=2, chunk_size=16, old_logp="rollout")
  opt = OptimizerConfig(lr=1e-3)
  state = init_train_state(sft_params, ucfg, opt)
  before = np.asarray(state.params["embed"]).copy()
  for step in range(3):
    problems, sc, out = _rollout(cfg, state.params, "A", recipe, seed=step)
    _, rewards = scoring.completions_and_rewards(TASK, TOK, problems, out, sc.n)
    adv = group_advantages(jnp.asarray(rewards) + 0.1 * np.arange(len(rewards)), sc.n)
    state, m = update_step(
      state,
      _batch(out, adv),
      jax.random.PRNGKey(step),
      model_config=cfg,
      cfg=ucfg,
      optimizer=opt,
      total_steps=3,
      precision=recipe.train,
      temperature=SC_A.temperature,
    )
    agree = {k: float(v) for k, v in m.items() if k.startswith("agree/") and np.ndim(v) == 0}
    assert agree["agree/n_tokens"] > 20, agree
    assert agree["agree/abs_diff_max"] == 0.0 and agree["agree/abs_diff_mean"] == 0.0, agree
    assert agree["agree/kl_k3"] == 0.0 and agree["agree/prob_ratio_error"] == 1.0, agree
    assert float(m["ratio_mean"]) == 1.0 and float(m["skipped_updates"]) == 0
  assert np.abs(np.asarray(state.params["embed"]) - before).max() > 0  # it did train


def test_truncated_rollout_logprobs_equal_the_training_forward_bitwise(model):
  """top-k and top-p on: the rollout records the log-prob under the truncated, renormalised
  distribution, and the training forward recomputes it under the same truncation of its own
  logits: under jet_exact the two are equal bit for bit (so the PPO ratio is exactly 1), and
  they are the truncated log-probs, not the full softmax's."""
  import dataclasses

  cfg, params = model
  prompts = [pieces.encode_prompt(TOK, p.prompt) for p in _prompts("A")]
  for top_k, top_p in ((5, 0.6),):
    sc = dataclasses.replace(SC_A, top_k=top_k, top_p=top_p)
    out = jax.tree_util.tree_map(
      np.asarray, sample(params, cfg, prompts, jax.random.PRNGKey(1), sc, EXACT.rollout)
    )
    m = out.mask
    assert m.sum() >= 40
    lp, _ = _lp(
      params,
      model_config=cfg,
      batch=_batch(out),
      precision=EXACT.train,
      temperature=np.float32(sc.temperature),
      chunk_size=16,
      top_k=top_k,
      top_p=top_p,
    )
    assert np.abs(np.asarray(lp) - out.logprobs)[m].max() == 0.0, (top_k, top_p)
    full = _train_logprobs(params, cfg, out, EXACT, sc.temperature)
    # Renormalised over a subset: never below the full softmax's, above it where tokens are cut.
    assert np.all(out.logprobs[m] >= full[m]) and np.mean(out.logprobs[m] > full[m]) > 0.5
    # The update step's own forward: its agreement metrics are exactly zero.
    ucfg = UpdateConfig(loss="grpo", chunk_size=16, old_logp="rollout")
    _, metrics = update_step(
      init_train_state(params, ucfg),
      _batch(out, np.linspace(-1, 1, len(out.tokens))),
      jax.random.PRNGKey(0),
      model_config=cfg,
      cfg=ucfg,
      precision=EXACT.train,
      temperature=sc.temperature,
      top_k=top_k,
      top_p=top_p,
    )
    assert float(metrics["agree/abs_diff_max"]) == 0.0 and float(metrics["ratio_mean"]) == 1.0
