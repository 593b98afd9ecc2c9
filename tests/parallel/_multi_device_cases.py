"""Multi-device cases, run on 8 simulated CPU devices by test_multi_device.py in a subprocess
(XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX starts).

Each case compares a sharded run with one device, under the jet recipe (FP8 fprop / dgrad /
wgrad, bf16 between operators). Tolerances, measured on the CPU backend:
  forward logits   all meshes within FWD_TOL of one device running the 8 rows (max 0.033
                   measured, logits of magnitude ~1): the CPU GEMM's summation order depends on
                   the matrix shapes, a flipped bf16 rounding can move an E4M3 value by one
                   step, and row-parallel / vocab-parallel splits sum float32 partials in
                   another order. data:8 is bit-identical to one device running each row
                   alone (the same program per device). The FP8 scales themselves never
                   straddle devices (no group crosses a shard).
  greedy sampling  tokens identical; a row may diverge only where the one-device top-2 logit
                   margin is below FWD_TOL (a near-tie). Recorded log-probs within LP_TOL.
  one update step  params within PARAM_TOL (AdamW's first step is ~lr * sign(g): a gradient
                   entry that is ~0 and changes sign with the summation order moves its param
                   by ~2 lr = 2e-6), loss within LOSS_TOL (3e-4 measured). Each device runs
                   its own rows, so the gradient is a sum across devices in another order than
                   one device's, data:8 included; and each device computes at most
                   MAX_FLOPS_SHARE of one device's FLOPs (measured 0.14-0.17 on these meshes;
                   0.79 under data:8 when XLA was left to place the activations).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetrl import parallel
from jetrl.models import forward, get_config, init_params
from jetrl.precision import get_recipe
from jetrl.rl import OptimizerConfig, UpdateConfig, init_train_state, make_train_batch, update_step
from jetrl.sampling import SamplingConfig, sample

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

MESHES = ["data:8", "data:2,fsdp:2,tensor:2", "fsdp:4,tensor:2"]
FWD_TOL = 1e-1  # float32 logits (|logit| <~ 1.5) of an FP8 model: one flipped E4M3 value
LP_TOL = 1e-1
PARAM_TOL = 2.5e-6  # lr = 1e-6 below: a sign flip of a ~0 gradient entry moves it by ~2 lr
LOSS_TOL = 5e-3
MAX_FLOPS_SHARE = 0.25  # 1/8 of the model's FLOPs, plus the optimizer (replicated on data:8)
# d_model 512, kv_dim 256, q_dim 512, d_ff 512: every FP8 shard stays a multiple of 128 on
# all three meshes (fsdp up to 4, tensor 2).
CFG = dataclasses.replace(
  get_config("tiny"),
  d_model=512,
  n_heads=8,
  n_kv_heads=4,
  head_dim=64,
  d_ff=512,
  n_layers=1,
  vocab_size=128,
  max_seq_len=128,
)
RECIPE = get_recipe("jet")
ROWS, T = 8, 16


def _tokens(seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(1, CFG.vocab_size, (ROWS, T)).astype(np.int32)


_REF = {}


def _params():
  if "params" not in _REF:
    _REF["params"] = init_params(CFG, jax.random.PRNGKey(0))
  return _REF["params"]


def _fwd(params, tokens):
  return jax.jit(lambda p, t: forward(p, CFG, t, precision=RECIPE.train))(params, tokens)


def _ref_logits():
  if "logits" not in _REF:
    _REF["logits"] = np.asarray(_fwd(_params(), _tokens()))
  return _REF["logits"]


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_forward_matches_one_device(mesh_spec):
  mesh = parallel.make_mesh(mesh_spec)
  lay = parallel.make_layout(mesh, CFG, "train", RECIPE)
  params = lay.shard_params(_params())
  assert params["layers"]["wq"].sharding.spec == lay.specs["layers"]["wq"]
  tokens = parallel.put(_tokens(), lay.rows_sharding(ROWS, strict=True))
  got = np.asarray(_fwd(params, tokens))
  ref = _ref_logits()
  diff = float(np.max(np.abs(got - ref)))
  print(f"forward {mesh_spec}: max |diff| {diff:.3g}")
  assert diff <= FWD_TOL, diff
  if mesh_spec == "data:8":
    # Each device runs one row: the same program as one device on that row alone, bit for
    # bit. (One device on 8 rows differs from 8 single-row runs within FWD_TOL: the CPU GEMM's
    # summation order depends on the row count, and a flipped bf16 rounding can move an FP8
    # value; that is the backend, not the sharding.)
    per_row = np.concatenate(
      [np.asarray(_fwd(_params(), _tokens()[r : r + 1])) for r in range(ROWS)]
    )
    np.testing.assert_array_equal(got, per_row)


def _greedy(params, layout=None):
  sc = SamplingConfig(max_new_tokens=6, temperature=0.0, n=2, prompt_len=16)
  prompts = [list(range(1 + i, 6 + 2 * i)) for i in range(4)]
  return sample(params, CFG, prompts, jax.random.PRNGKey(1), sc, RECIPE.rollout, layout=layout)


# The sampling layout drops fsdp: "fsdp:4,tensor:2" samples like "data:2,fsdp:2,tensor:2".
@pytest.mark.parametrize("mesh_spec", MESHES[:2])
def test_greedy_sampling_matches_one_device(mesh_spec):
  if "greedy" not in _REF:
    _REF["greedy"] = jax.tree_util.tree_map(np.asarray, _greedy(_params()))
  ref = _REF["greedy"]
  mesh = parallel.make_mesh(mesh_spec)
  train = parallel.make_layout(mesh, CFG, "train", RECIPE)
  samp = parallel.make_layout(mesh, CFG, "sample", RECIPE)
  params, _ = parallel.switch_layout(train.shard_params(_params()), train, samp)
  assert all(
    "fsdp" not in str(s)
    for s in jax.tree_util.tree_leaves(
      samp.specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
  )
  out = jax.tree_util.tree_map(np.asarray, _greedy(params, samp))
  for r in range(ref.tokens.shape[0]):
    same = out.tokens[r] == ref.tokens[r]
    if same.all():
      np.testing.assert_allclose(out.logprobs[r], ref.logprobs[r], atol=LP_TOL)
      continue
    first = int(np.argmin(same))
    # A divergence is allowed only at a near-tie of the one-device model.
    seq = np.concatenate([ref.prompt_tokens[r], ref.tokens[r][:first]])[None]
    logits = np.asarray(_fwd(_params(), jnp.asarray(seq)))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] <= FWD_TOL, (mesh_spec, r, first, top2)
  print(f"greedy {mesh_spec}: tokens equal {np.mean(out.tokens == ref.tokens):.3f}")


def _batch():
  rng = np.random.default_rng(3)
  p, t = 8, 16
  prompt = rng.integers(1, CFG.vocab_size, (ROWS, p)).astype(np.int32)
  pmask = np.ones((ROWS, p), bool)
  pmask[:, :2] = False
  toks = rng.integers(1, CFG.vocab_size, (ROWS, t)).astype(np.int32)
  mask = np.arange(t)[None] < rng.integers(4, t + 1, (ROWS, 1))
  lp = -rng.uniform(1, 6, (ROWS, t)).astype(np.float32) * mask
  adv = rng.normal(size=(ROWS,)).astype(np.float32)
  return make_train_batch(prompt, pmask, toks, mask, lp, adv)


# The PPO ratio against the batch's recorded log-probs: the comparison isolates the sharding.
# With old_logp="recompute" the ratio's denominator is a pre-update forward whose last bits
# depend on the rows each program sees (data:8 runs one row per device), and AdamW's first step
# turns a gradient entry that is 0 in one run and ~1e-12 in the other into a difference of lr.
# chunk_size 8: the log-prob head runs in chunks, so a mesh gathers its weight once for them all.
UCFG = UpdateConfig(micro_batches=1, minibatches=1, old_logp="rollout", chunk_size=8)
OPT = OptimizerConfig(lr=1e-6)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_update_step_matches_one_device(mesh_spec):
  key = jax.random.PRNGKey(7)
  kw = dict(model_config=CFG, cfg=UCFG, optimizer=OPT, precision=RECIPE.train)
  if "update" not in _REF:
    state, batch = init_train_state(_params(), UCFG), _batch()
    _REF["flops"] = _flops(update_step.lower(state, batch, key, **kw).compile())
    st, m = update_step(state, batch, key, **kw)
    _REF["update"] = (jax.tree_util.tree_map(np.asarray, st.params), float(m["loss"]))
  ref_params, ref_loss = _REF["update"]
  mesh = parallel.make_mesh(mesh_spec)
  lay = parallel.make_layout(mesh, CFG, "train", RECIPE)
  state = lay.shard_state(init_train_state(_params(), UCFG))
  shardings = jax.tree_util.tree_map(lambda a: a.sharding, state)
  batch = lay.shard_batch(_batch())
  step = parallel.sharded_update_step(lay)
  # Each device computes its share: the activations keep the batch's rows (Layout.token_split).
  share = _flops(step.lower(state, batch, key, **kw).compile()) / _REF["flops"]
  assert share <= MAX_FLOPS_SHARE, f"{mesh_spec}: each device computes {share:.2f} of the FLOPs"
  st, m = step(state, batch, key, **kw)
  # Explicit out shardings: the state keeps its layout.
  assert jax.tree_util.tree_all(
    jax.tree_util.tree_map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), st, shardings)
  )
  diffs = jax.tree_util.tree_map(
    lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), st.params, ref_params
  )
  worst = max(jax.tree_util.tree_leaves(diffs))
  print(
    f"update {mesh_spec}: max |param diff| {worst:.3g}, loss {float(m['loss'])!r} vs "
    f"{ref_loss!r}, FLOPs a device {share:.3f} of one device's"
  )
  assert worst <= PARAM_TOL, diffs
  assert abs(float(m["loss"]) - ref_loss) <= LOSS_TOL
  assert float(m["skipped_updates"]) == 0


def test_the_token_split_gathers_the_head_over_fsdp_only():
  """The LM head's weight (rule fsdp x vocab) is gathered over `fsdp` before the head's chunk
  loop and keeps its vocabulary split over `tensor` (hand-written specs)."""
  P = jax.sharding.PartitionSpec
  want = {"fsdp:4,tensor:2": P(None, "tensor"), "data:2,fsdp:2,tensor:2": P(None, "tensor")}
  for spec, head in want.items():
    lay = parallel.make_layout(parallel.make_mesh(spec), CFG, "train", RECIPE)
    assert lay.specs["lm_head"] == P("fsdp", "tensor"), lay.specs["lm_head"]
    assert lay.token_split.head == head, (spec, lay.token_split.head)
  tied = dataclasses.replace(CFG, tie_embeddings=True)
  lay = parallel.make_layout(parallel.make_mesh("fsdp:4,tensor:2"), tied, "train", RECIPE)
  assert lay.token_split.head == P("tensor", None)  # embed [V, D]: (vocab, fsdp)


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_checkpoint_saved_under_one_mesh_restores_under_another(tmp_path):
  from jetrl.train.checkpoint import Checkpointer

  a = parallel.make_layout(parallel.make_mesh("data:2,fsdp:2,tensor:2"), CFG, "train", RECIPE)
  b = parallel.make_layout(parallel.make_mesh("fsdp:4,tensor:2"), CFG, "train", RECIPE)
  state = init_train_state(_params(), UCFG)
  tree = {k: v for k, v in state._asdict().items() if v is not None}
  saved = a.shard_state(tree)
  ck = Checkpointer(str(tmp_path))
  ck.save(1, saved, {"step": 1})
  target = b.shard_state(tree)
  restored, meta = ck.restore(1, target)
  ck.close()
  assert meta["step"] == 1
  jax.tree_util.tree_map(
    lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), restored, saved
  )
  for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  wq = restored["params"]["layers"]["wq"]
  assert wq.sharding.spec == b.specs["layers"]["wq"]
  assert len(wq.addressable_shards) == 8 and wq.addressable_shards[0].data.shape == (
    CFG.n_layers,
    128,
    256,
  )


def test_invalid_meshes_are_clear_errors():
  with pytest.raises(ValueError, match="multiply to 6, but there are 8 devices"):
    parallel.make_mesh("data:3,tensor:2")
  with pytest.raises(ValueError, match="unknown axis 'model'"):
    parallel.make_mesh("data:4,model:2")
  tiny = get_config("tiny")  # n_kv_heads 2, d_model 256
  with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by mesh axis 'tensor'"):
    parallel.make_layout(parallel.make_mesh("data:2,tensor:4"), tiny, "train")
  with pytest.raises(
    ValueError,
    match=r"layers/wq.*contraction \(input\) dim K=256 split over "
    r"mesh axis 'fsdp' \(size 4\) into shards of 64.*block 128",
  ):
    parallel.make_layout(parallel.make_mesh("fsdp:4,tensor:2"), tiny, "train", RECIPE)
  # The same mesh is fine without FP8 (bf16 has no blocks), and FP8 with the sampling layout.
  parallel.make_layout(
    parallel.make_mesh("fsdp:4,tensor:2"),
    dataclasses.replace(tiny, n_kv_heads=4),
    "train",
    get_recipe("bf16"),
  )


def test_runner_with_mesh(tmp_path):
  from jetrl.train import TrainConfig, run

  cfg = TrainConfig(
    steps=1, prompts_per_step=4, recipe="jet", mesh="data:4,fsdp:2", workdir=str(tmp_path)
  ).replace(
    model={"n_layers": 1},
    task={"difficulty": 1, "length": 2},
    sampling={"n": 2, "max_new_tokens": 4},
    eval={"every": None, "size": 2},
    checkpoint={"every": 1},
    logging={"tensorboard": False, "plots": False},
    optimizer={"lr": 1e-4},
  )
  lines = []
  summary = run(cfg, log=lines.append)
  assert summary["skipped_updates"] == 0
  assert any("mesh data:4,fsdp:2" in line for line in lines), lines
  assert any("params train -> sample layout" in line for line in lines), lines
  with open(tmp_path / "metrics.jsonl") as f:
    assert '"time/reshard"' in f.read()
  # The finished run, resumed under another mesh: its checkpoint restores into data:8.
  lines.clear()
  run(cfg.replace(mesh="data:8"), log=lines.append)
  assert any("resumed" in line for line in lines), lines


def test_exact_recipe_sampler_on_a_data_mesh_equals_one_device_training_forward():
  """jet_exact: the rollout's log-probs, sampled with the rows over 8 devices, equal the
  training forward's on one device bit for bit (docs/numerics.md, "Bitwise on-policy")."""
  from jetrl.models import token_logprobs

  exact = get_recipe("jet_exact")
  mesh_spec = "data:8"
  mesh = parallel.make_mesh(mesh_spec)
  samp = parallel.make_layout(mesh, CFG, "sample", exact)
  prompts = [list(range(1 + i, 4 + 3 * i)) for i in range(4)]
  sc = SamplingConfig(max_new_tokens=10, temperature=1.0, n=2, prompt_len=16)
  out = sample(
    samp.shard_params(_params()),
    CFG,
    prompts,
    jax.random.PRNGKey(2),
    sc,
    exact.rollout,
    layout=samp,
  )
  out = jax.tree_util.tree_map(np.asarray, out)
  seq = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
  seq_mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
  pos = np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0)
  lp, _ = jax.jit(
    lambda p, *a: token_logprobs(
      p, CFG, a[0], a[1], precision=exact.train, positions=a[2], attention_mask=a[3]
    )
  )(_params(), seq[:, :-1], seq[:, 1:], pos[:, :-1], seq_mask[:, :-1])
  lp = np.asarray(lp)[:, -out.tokens.shape[1] :]
  diff = np.abs(lp - out.logprobs)[out.mask]
  print(f"jet_exact sampler {mesh_spec}: {out.mask.sum()} tokens, max |dlogp| {diff.max()}")
  assert out.mask.sum() > 40 and diff.max() == 0.0


# --- custom calls partitioned as their operands (jetrl.kernels.partition) -------------------


def _blockwise_gemm(a, sa_t, b, sb):
  """a [P, C] in 1 x 128 groups (scales transposed), b [Q, C] in 128 x 128 blocks, as jnp."""
  ad = a * jnp.repeat(sa_t.T, 128, axis=1)
  return ad @ (b * jnp.repeat(jnp.repeat(sb, 128, 0), 128, 1)).T


def test_a_partitioned_gemm_shards_rows_and_sums_a_split_contraction():
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jetrl.kernels import partition

  f = partition.sharded(
    _blockwise_gemm,
    "p c, cb p, q c, qb cb -> p q",
    ties={"cb": "c", "qb": "q"},
    block={"c": 128, "q": 128},
  )
  mesh = parallel.make_mesh("data:4,tensor:2")
  rng = np.random.default_rng(0)
  p_, c_, q_ = 1024, 512, 256
  a, b = rng.normal(size=(p_, c_)), rng.normal(size=(q_, c_))
  sa, sb = rng.uniform(1, 2, (c_ // 128, p_)), rng.uniform(1, 2, (q_ // 128, c_ // 128))
  # the float64 blockwise formula, block by block
  ref = sum(
    np.outer(sa[k], np.repeat(sb[:, k], 128)) * (a[:, 128 * k : 128 * (k + 1)] @ b[:, 128 * k : 128 * (k + 1)].T)
    for k in range(c_ // 128)
  )  # fmt: skip
  args = [jnp.asarray(v, jnp.float32) for v in (a, sa, b, sb)]
  cases = {  # operands' specs -> (all-gathers expected, all-reduces expected, result spec)
    "rows": ((P("data"), P(None, "data"), P(), P()), False, False, P("data")),
    "rows, tensor-split b": (
      (P("data"), P(None, "data"), P("tensor"), P("tensor")), False, False, P("data", "tensor")
    ),
    "split contraction": ((P(None, "data"), P("data"), P(None, "data"), P(None, "data")), False, True, P()),
    # 512 columns over 8 devices: 64 a device, not whole 128-groups: gathered, still right
    "ragged contraction": ((P(None, ("data", "tensor")), P(), P(), P()), True, False, P()),
  }  # fmt: skip
  for name, (specs, gather, reduce, out_spec) in cases.items():
    g = jax.jit(f, in_shardings=tuple(NamedSharding(mesh, s) for s in specs))
    y = g(*args)
    hlo = g.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-3, err_msg=name)
    assert ("all-gather" in hlo) == gather and ("all-reduce" in hlo) == reduce, name
    assert y.sharding.spec == out_spec, (name, y.sharding.spec)


def test_the_quantization_and_swiglu_kernels_run_on_their_shards():
  """Interpret mode: a row-sharded activation's groups, and SwiGLU's backward, bit for bit as
  on one device, each device's kernel on its own rows."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jetrl.kernels import quant_kernel, swiglu_kernel

  mesh = parallel.make_mesh("data:8")
  rows = NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(1024, 256)) * np.exp(rng.normal(size=(1024, 1))), jnp.bfloat16)
  e4 = jnp.float8_e4m3fn

  def quant(v):
    return quant_kernel.quantize_rows_cols(v, e4, interpret=True)

  def swiglu(g, u, d):
    return swiglu_kernel.swiglu_backward(g, u, d, jnp.bfloat16, e4, e4, e4, interpret=True)

  gu = [jnp.asarray(rng.normal(size=(1024, 256)), jnp.bfloat16) for _ in range(3)]
  for fn, args in ((quant, (x,)), (swiglu, tuple(gu))):
    one = jax.jit(fn)(*args)
    g = jax.jit(fn, in_shardings=(rows,) * len(args))
    sharded = g(*args)
    # no device holds a whole input: each kernel reads its own 128 rows
    assert "bf16[1024,256]" not in g.lower(*args).compile().as_text()
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(sharded)):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_flash_attention_runs_on_each_devices_rows_forward_and_backward():
  """Interpret mode, rows split over 8 devices: the output and the gradients as on one device,
  bit for bit, and no device holds the whole batch's q."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jetrl.kernels import attention, flash

  assert flash.partitioned_backward_available()
  mesh = parallel.make_mesh("data:8")
  rows = NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(2)
  b, t, h, dh = 8, 128, 2, 64
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.bfloat16) for _ in range(3))
  mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(t // 2, t + 1, (b, 1)), jnp.int32)

  def loss(q, k, v, mask):
    out = attention.attend_flash(q, k, v, mask, jnp.bfloat16, interpret=True)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(h * dh))), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  one = jax.jit(grad)(q, k, v, mask)
  g = jax.jit(grad, in_shardings=(rows,) * 4)
  sharded = g(q, k, v, mask)
  assert f"bf16[{b},{t},{h},{dh}]" not in g.lower(q, k, v, mask).compile().as_text()
  (l1, *rest1), (l2, *rest2) = (jax.tree_util.tree_leaves(r) for r in (one, sharded))
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)  # the test's sum, split
  for a, c in zip(rest1, rest2):  # the output, dq, dk, dv
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_the_norm_kernel_on_rows_or_columns_of_a_mesh():
  """Interpret mode: x split by rows, each device's kernel gives one device's bits; split by
  columns (each device 128 of them), the statistic is summed across devices first, and the
  groups agree with one device's up to a last-bit change of the norm (another sum order)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jetrl.kernels.norm_kernel import norm_rows_cols

  mesh = parallel.make_mesh("data:8")
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(1024, 1024)) * 2, jnp.bfloat16)
  w = jnp.asarray(1 + 0.1 * rng.normal(size=(1024,)), jnp.float32)
  e4 = jnp.float8_e4m3fn

  def fn(a, b):
    return norm_rows_cols(a, b, 1e-6, jnp.bfloat16, e4, e4, interpret=True)

  one = jax.tree_util.tree_leaves(jax.jit(fn)(x, w))
  for spec, exact in ((P("data"), True), (P(None, "data"), False)):
    g = jax.jit(fn, in_shardings=(NamedSharding(mesh, spec), NamedSharding(mesh, P())))
    got = jax.tree_util.tree_leaves(g(x, w))
    assert "bf16[1024,1024]" not in g.lower(x, w).compile().as_text()  # nothing gathered
    for a, b in zip(one, got):
      a, b = np.asarray(a), np.asarray(b)
      if exact:
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
      else:  # an FP8 value moved by a last-bit change of its norm: one E4M3 step at most
        assert np.mean(a.view(np.uint8) == b.view(np.uint8)) > 0.97
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0.07)
