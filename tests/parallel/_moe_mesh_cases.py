"""A mixture of experts on 8 simulated CPU devices (run by test_multi_device.py in a
subprocess): the sampler and one update on data:2,fsdp:2,tensor:2 against one device, under
the jet recipe. Each expert's matrices are split like the dense MLP's (D over fsdp, the
expert's width over tensor, every FP8 block on one shard); the tolerances are the dense cases'
(tests/parallel/_multi_device_cases.py: another summation order of float32 partials)."""

import jax
import numpy as np

from jetrl import parallel
from jetrl.models import ModelConfig, init_params
from jetrl.precision import get_recipe
from jetrl.rl import OptimizerConfig, UpdateConfig, init_train_state, make_train_batch, update_step
from jetrl.sampling import SamplingConfig, sample

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

MESH = "data:2,fsdp:2,tensor:2"
LP_TOL, PARAM_TOL, LOSS_TOL = 1e-1, 2.5e-6, 5e-3
# d_model 256 / fsdp 2, q 512 / kv 256 / expert width 256 over tensor 2: 128-wide FP8 shards.
CFG = ModelConfig(
  family="qwen3_moe", vocab_size=128, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2,
  head_dim=128, d_ff=256, qk_norm=True, n_experts=4, experts_per_token=2, moe_d_ff=256,
  max_seq_len=64,
)  # fmt: skip
RECIPE = get_recipe("jet")
PARAMS = jax.tree_util.tree_map(
  lambda a: a * 3.0 if a.ndim >= 2 else a, init_params(CFG, jax.random.PRNGKey(0))
)


def _sample(params, layout=None):
  sc = SamplingConfig(max_new_tokens=6, temperature=0.0, n=2, prompt_len=8)
  prompts = [list(range(1 + i, 4 + 2 * i)) for i in range(4)]
  out = sample(params, CFG, prompts, jax.random.PRNGKey(1), sc, RECIPE.rollout, layout=layout)
  return jax.tree_util.tree_map(np.asarray, out)


def test_sampler_on_a_mesh_matches_one_device():
  ref = _sample(PARAMS)
  mesh = parallel.make_mesh(MESH)
  train = parallel.make_layout(mesh, CFG, "train", RECIPE)
  samp = parallel.make_layout(mesh, CFG, "sample", RECIPE)
  params, _ = parallel.switch_layout(train.shard_params(PARAMS), train, samp)
  assert params["layers"]["experts_gate"].sharding.spec == samp.specs["layers"]["experts_gate"]
  out = _sample(params, samp)
  same = out.tokens == ref.tokens
  print(f"moe greedy {MESH}: tokens equal {same.mean():.3f}")
  assert same.mean() >= 0.9, same  # a row may leave the other at a near-tie
  rows = same.all(1)
  assert rows.sum() >= 6
  np.testing.assert_allclose(out.logprobs[rows], ref.logprobs[rows], atol=LP_TOL)
  agree = np.all(np.sort(out.routes[rows], -1) == np.sort(ref.routes[rows], -1), -1)
  print(f"moe greedy {MESH}: (token, layer) routing equal {agree.mean():.3f}")
  assert agree.mean() >= 0.9


def _batch():
  rng = np.random.default_rng(3)
  rows, p, t = 8, 8, 16
  prompt = rng.integers(1, CFG.vocab_size, (rows, p)).astype(np.int32)
  pmask = np.ones((rows, p), bool)
  pmask[:, :2] = False
  toks = rng.integers(1, CFG.vocab_size, (rows, t)).astype(np.int32)
  mask = np.arange(t)[None] < rng.integers(4, t + 1, (rows, 1))
  lp = -rng.uniform(1, 6, (rows, t)).astype(np.float32) * mask
  adv = rng.normal(size=(rows,)).astype(np.float32)
  return make_train_batch(prompt, pmask, toks, mask, lp, adv)


def test_update_on_a_mesh_matches_one_device():
  ucfg = UpdateConfig(micro_batches=1, minibatches=1, old_logp="rollout", chunk_size=8)
  key = jax.random.PRNGKey(7)
  kw = dict(model_config=CFG, cfg=ucfg, optimizer=OptimizerConfig(lr=1e-6), precision=RECIPE.train)
  ref, m_ref = update_step(init_train_state(PARAMS, ucfg), _batch(), key, **kw)
  lay = parallel.make_layout(parallel.make_mesh(MESH), CFG, "train", RECIPE)
  state = lay.shard_state(init_train_state(PARAMS, ucfg))
  assert state.params["layers"]["experts_down"].sharding.spec == lay.specs["layers"]["experts_down"]
  st, m = parallel.sharded_update_step(lay)(state, lay.shard_batch(_batch()), key, **kw)
  diffs = jax.tree_util.tree_map(
    lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), st.params, ref.params
  )
  worst = max(jax.tree_util.tree_leaves(diffs))
  print(f"moe update {MESH}: max |param diff| {worst:.3g}, loss {float(m['loss'])!r} vs "
        f"{float(m_ref['loss'])!r}")  # fmt: skip
  assert worst <= PARAM_TOL, diffs
  assert abs(float(m["loss"]) - float(m_ref["loss"])) <= LOSS_TOL
  assert float(m["skipped_updates"]) == 0
