"""LoRA on a frozen base (jetrl.models.lora): the adapted projection and its gradients against
float64 numpy; the base quantized once, bit for bit what quantizing it at every step gives;
the frozen base really float8 in the traced program; under `jet` the rollout reads the training
forward's FP8 base and gives its log-probs, under `jet_exact` bit for bit; an update under every
recipe moves the adapters (and only them) in the advantage's direction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl.config import ConfigError
from jetrl.models import ModelConfig, forward, init_params
from jetrl.models.lora import (
  LoraConfig,
  LoraWeight,
  attach,
  check_adapters,
  freeze_base,
  init_adapters,
  lora_linear,
  merge,
)
from jetrl.precision import QuantizedWeight, get_recipe
from jetrl.precision.recipes import RECIPES, Precision
from jetrl.rl import (
  OptimizerConfig,
  UpdateConfig,
  init_lora_train_state,
  make_train_batch,
  policy_logprobs,
  update_step,
)
from jetrl.sampling import SamplingConfig, sample

LORA = LoraConfig(rank=4, alpha=8.0)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
SC = SamplingConfig(max_new_tokens=10, temperature=1.0, n=2, stop_ids=(3,))
_lp = jax.jit(policy_logprobs, static_argnames=("model_config", "precision"))


def trained_like(adapters, seed=2, std=0.05):
  """Adapters as after some training: b no longer zero."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
  return jax.tree_util.tree_map(
    lambda a: a + std * jax.random.normal(next(keys), a.shape), adapters
  )


@pytest.fixture(scope="module")
def setup(tiny_model):
  cfg, params = tiny_model
  adapters = trained_like(init_adapters(cfg, LORA, jax.random.PRNGKey(1)))
  return cfg, params, adapters


def test_config_is_checked():
  with pytest.raises(ConfigError, match="targets"):
    LoraConfig(rank=4, targets=("q", "qkv"))
  with pytest.raises(ConfigError, match="targets: lists a projection twice"):
    LoraConfig(rank=4, targets=("q", "q"))
  with pytest.raises(ConfigError, match="rank"):
    LoraConfig(rank=-1)
  assert LoraConfig(rank=8, alpha=16.0, targets=("v", "q")).weights == ("wq", "wv")
  assert LoraConfig(rank=8, alpha=16.0).scale == 2.0


def test_a_mixture_of_experts_is_refused_by_name():
  """No dense MLP projections to adapt: a ValueError naming the flag, not a KeyError."""
  moe = ModelConfig(
    family="qwen3_moe", vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
    head_dim=32, qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=32,
  )  # fmt: skip
  lora = LoraConfig(rank=4, targets=("q", "v"))
  for call in (
    lambda: init_adapters(moe, lora, jax.random.PRNGKey(0)),
    lambda: check_adapters({}, moe, lora),
  ):
    with pytest.raises(ValueError, match=r"--lora.rank=4: .* is a mixture of experts"):
      call()
  base = init_params(moe, jax.random.PRNGKey(0))
  for recipe in ("bf16", "jet"):
    with pytest.raises(ValueError, match=r"mixture of experts .*--lora.rank=0"):
      freeze_base(base, get_recipe(recipe).train)


def test_init_is_the_base_and_shapes_are_checked(setup):
  cfg, params, _ = setup
  ad = init_adapters(cfg, LORA, jax.random.PRNGKey(1))
  k = cfg.d_model
  a = np.asarray(ad["wq"]["a"])
  assert (
    a.shape == (1, k, 4)
    and np.abs(a).max() <= 1 / np.sqrt(k)
    and np.abs(a).max() > 0.5 / np.sqrt(k)
  )
  assert not np.any(np.asarray(ad["w_down"]["b"]))  # b = 0: the adapted model is the base
  toks = jnp.array([[1, 2, 3, 4]])
  # The base alone runs q / k / v as one GEMM on the weights concatenated, the adapted model
  # (LoRA projections stay apart) as three: the same values to float32 rounding.
  np.testing.assert_allclose(
    forward(attach(params, ad, LORA), cfg, toks), forward(params, cfg, toks), rtol=1e-5, atol=1e-6
  )
  bad = dict(ad, wq={"a": ad["wq"]["a"][..., :2], "b": ad["wq"]["b"]})
  with pytest.raises(ValueError, match=r"adapters\['wq'\]\['a'\] has shape \(1, \d+, 2\)"):
    check_adapters(bad, cfg, LORA)


def test_lora_linear_and_its_gradients_match_float64():
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(5, 32)), rng.normal(size=(32, 24)) / 6
  a, b, g = rng.normal(size=(32, 4)) / 6, rng.normal(size=(4, 24)) / 2, rng.normal(size=(5, 24))
  s = 2.0
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  p = Precision("float32")

  def loss(x, a, b):
    return jnp.sum(f32(g) * lora_linear(x, LoraWeight(f32(w), a, b, s), p, jnp.float32))

  val, (dx, da, db) = jax.value_and_grad(loss, argnums=(0, 1, 2))(f32(x), f32(a), f32(b))
  y = x @ w + s * (x @ a) @ b
  np.testing.assert_allclose(val, np.sum(g * y), rtol=1e-5)
  np.testing.assert_allclose(dx, g @ w.T + s * g @ b.T @ a.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(da, s * x.T @ g @ b.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(db, s * (x @ a).T @ g, rtol=1e-4, atol=1e-5)


def test_adapted_model_is_the_float64_merged_model(setup):
  cfg, params, adapters = setup
  toks = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
  p = get_recipe("fp32").train
  got = forward(attach(params, adapters, LORA), cfg, toks, precision=p)
  want = forward(merge(params, adapters, LORA), cfg, toks, precision=p)  # numpy float64 merge
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("recipe", ["jet", "jet_exact"])
def test_base_quantized_once_is_bitwise_quantizing_every_step(setup, recipe):
  """Logits and adapter gradients; the adapters' gradients pass through every frozen FP8
  projection's backward (dx from its blocks), so that is bit for bit `linear`'s too."""
  cfg, params, adapters = setup
  train = get_recipe(recipe).train
  frozen = freeze_base(params, train)
  for name in ("wq", "w_down"):
    wq = frozen["layers"][name]
    assert isinstance(wq, QuantizedWeight) and wq.q.dtype == jnp.float8_e4m3fn
  toks = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])

  def loss(ad, base):
    return jnp.sum(forward(attach(base, ad, LORA), cfg, toks, precision=train)[..., :5])

  once = jax.jit(jax.value_and_grad(loss))(adapters, frozen)
  each = jax.jit(jax.value_and_grad(loss))(adapters, params)  # linear quantizes at every call
  jax.tree_util.tree_map(np.testing.assert_array_equal, once, each)


def test_traced_update_holds_the_base_in_float8(setup):
  """Under jet the frozen base reaches the update program as float8 arrays (no stored-dtype
  copy of the projection weights), and the optimizer state holds adapter-shaped leaves only."""
  cfg, params, adapters = setup
  train = get_recipe("jet").train
  state = init_lora_train_state(params, adapters, LORA, train, UpdateConfig())
  f8 = [a for a in jax.tree_util.tree_leaves(state.frozen) if a.dtype == jnp.float8_e4m3fn]
  assert len(f8) == 7  # the seven projections of the one layer
  n_adapter = sum(a.size for a in jax.tree_util.tree_leaves(adapters))
  opt_sizes = [a.size for a in jax.tree_util.tree_leaves(state.opt_state) if a.ndim > 0]
  assert sum(opt_sizes) == 2 * n_adapter  # AdamW's two moments of the adapters, nothing else


@pytest.fixture(scope="module")
def rollouts(setup):
  cfg, params, adapters = setup
  out = {}
  for recipe in ("jet", "jet_exact"):
    r = get_recipe(recipe)
    policy = attach(freeze_base(params, r.train), adapters, LORA)
    ro = sample(policy, cfg, PROMPTS, jax.random.PRNGKey(3), SC, r.rollout)
    batch = make_train_batch(
      ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask, ro.logprobs, np.zeros(8, np.float32)
    )
    lp, _ = _lp(policy, model_config=cfg, batch=batch, precision=r.train)
    m = np.asarray(batch.mask)
    out[recipe] = (np.asarray(lp) * m, np.asarray(batch.rollout_logprobs) * m, m)
  return out


def test_jet_rollout_is_the_training_forward(rollouts):
  train, roll, mask = rollouts["jet"]
  assert mask.sum() > 20
  assert np.max(np.abs(train - roll)) < 2e-2  # the same FP8 computation, batch-dependent sums


def test_jet_exact_rollout_is_the_training_forward_bit_for_bit(rollouts):
  train, roll, mask = rollouts["jet_exact"]
  assert mask.sum() > 20
  assert np.max(np.abs(train - roll)) == 0.0


@pytest.fixture(scope="module")
def batch(setup):
  cfg, params, _ = setup
  ro = sample(params, cfg, PROMPTS, jax.random.PRNGKey(1), SC, get_recipe("bf16").rollout)
  adv = np.array([1.0, -1.0] * 4, np.float32)
  return make_train_batch(ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask, ro.logprobs, adv)


# One recipe per distinct training precision (the rollout-only and crossover recipes train
# as bf16, jet or jet_exact do).
TRAINS = [
  n
  for i, n in enumerate(RECIPES)
  if all(get_recipe(n).train != get_recipe(m).train for m in RECIPES[:i])
]


@pytest.mark.parametrize("recipe", TRAINS)
def test_update_trains_the_adapters_only(setup, batch, recipe):
  cfg, params, adapters = setup
  train = get_recipe(recipe).train
  ucfg = UpdateConfig(loss="dapo", aggregation="token")
  state = init_lora_train_state(params, adapters, LORA, train, ucfg)
  base_before = jax.tree_util.tree_map(np.array, state.frozen)
  policy0 = attach(state.frozen, state.params, LORA)
  lp0, _ = _lp(policy0, model_config=cfg, batch=batch, precision=train)
  state, m = update_step(
    state,
    batch,
    jax.random.PRNGKey(0),
    model_config=cfg,
    cfg=ucfg,
    optimizer=OptimizerConfig(lr=3e-3),
    precision=train,
    lora=LORA,
  )
  assert m["skipped_updates"] == 0 and m["grad_norm"] > 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, base_before, state.frozen)
  lp1, _ = _lp(
    attach(state.frozen, state.params, LORA), model_config=cfg, batch=batch, precision=train
  )
  mask = np.asarray(batch.mask)
  delta = (np.asarray(lp1) - np.asarray(lp0)) * mask
  adv = np.asarray(batch.advantages)
  # Rows with a positive advantage gained log-probability, negative ones lost it.
  assert delta[adv > 0].sum() > 0 > delta[adv < 0].sum()
