"""The jitted policy-gradient update: one rollout batch in, new params and metrics out.

Everything runs inside one `jit` under the training precision (`recipe.train`):
  1. a no-grad training forward over the whole batch gives the pre-update log-probs: they are
     the rollout/training agreement metrics, the importance-sampling (IS) weights' numerator,
     and (with old_logp="recompute") the PPO ratio's "old" log-probs;
  2. `ppo_epochs` passes over `minibatches` shuffled minibatches, each split into
     `micro_batches` for gradient accumulation; every (micro-)loss returns (numerator,
     denominator) and the denominators are fixed per minibatch, so accumulation is exact;
  3. optax (global-norm clipping, AdamW, warmup + cosine or constant schedule). An optimizer
     step whose loss, gradients, new params or new optimizer state hold a NaN or Inf is
     skipped (params and optimizer state stay as they were) and counted: checking the result
     as well as the gradients catches what finite gradients can still produce (a NaN in the
     optimizer state, an overflowing update), so nothing non-finite reaches the params. The
     RL loop stops a run whose updates are all skipped for several steps in a row
     (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jetrl.precision import Precision
from jetrl.rl.agreement import DEFAULT_EDGES, agreement_metrics
from jetrl.rl.batch import TrainBatch, policy_logprobs
from jetrl.rl.correction import IS_METHODS, importance_weights
from jetrl.rl.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, ppo_clip_loss

LOSSES = ("grpo", "dapo", "dr_grpo")
OLD_LOGP_SOURCES = ("rollout", "recompute")
SCHEDULES = ("constant", "cosine")
REMAT_POLICIES = ("auto", "none", "layer")
MASTER_DTYPES = ("float32", "bfloat16")

# Per-loss defaults: (clip_high, aggregation, normalize advantages by the group std).
LOSS_DEFAULTS = {
    "grpo": (0.2, "seq_mean_token_mean", True),
    "dapo": (0.28, "token", True),
    "dr_grpo": (0.2, "constant", False),
}


def _one_of(name, value, accepted):
  if value not in accepted:
    raise ValueError(f"{name}={value!r} is not accepted; choose one of {list(accepted)}")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """Configuration of the update (static under jit). None fields take the loss's default."""
  loss: str = "grpo"
  clip_low: float = 0.2
  clip_high: Optional[float] = None
  aggregation: Optional[str] = None
  max_tokens: Optional[int] = None       # Dr.GRPO's constant normaliser (tokens per row)
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  is_method: str = "none"
  is_cap: float = 2.0
  old_logp: str = "rollout"
  ppo_epochs: int = 1
  minibatches: int = 1
  micro_batches: int = 1
  lr: float = 1e-5
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 1000
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.999
  adam_eps: float = 1e-8
  temperature: float = 1.0
  master_dtype: str = "float32"
  chunk_size: int = 256
  remat: str = "auto"      # "none", "layer" (recompute each layer in the backward), "auto"

  def __post_init__(self):
    _one_of("loss", self.loss, LOSSES)
    _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    _one_of("is_method", self.is_method, IS_METHODS)
    _one_of("old_logp", self.old_logp, OLD_LOGP_SOURCES)
    _one_of("schedule", self.schedule, SCHEDULES)
    _one_of("master_dtype", self.master_dtype, MASTER_DTYPES)
    if isinstance(self.remat, bool):  # older configs: True / False
      object.__setattr__(self, "remat", "layer" if self.remat else "none")
    _one_of("remat", self.remat, REMAT_POLICIES)
    if self.aggregation is not None:
      _one_of("aggregation", self.aggregation, AGGREGATIONS)
    for name in ("ppo_epochs", "minibatches", "micro_batches", "chunk_size", "total_steps"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name in ("clip_low", "kl_coef", "entropy_coef", "is_cap", "lr", "weight_decay",
                 "max_grad_norm", "b1", "b2", "adam_eps", "temperature"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if self.clip_high is not None and not math.isfinite(self.clip_high):
      raise ValueError(f"clip_high must be a finite number or None, got {self.clip_high!r}")
    if self.warmup_steps < 0 or self.lr <= 0 or self.max_grad_norm <= 0:
      raise ValueError("warmup_steps must be >= 0, lr > 0 and max_grad_norm > 0; got "
                       f"{self.warmup_steps}, {self.lr}, {self.max_grad_norm}")
    if self.weight_decay < 0 or self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError("weight_decay, kl_coef and entropy_coef must be >= 0; got "
                       f"{self.weight_decay}, {self.kl_coef}, {self.entropy_coef}")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.adam_eps > 0):
      raise ValueError(f"b1 and b2 must be in [0, 1) and adam_eps > 0; got {self.b1}, "
                       f"{self.b2}, {self.adam_eps}")
    if self.is_cap < 1:
      raise ValueError(f"is_cap must be >= 1, got {self.is_cap}")
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0 for the update, got {self.temperature}")

  @property
  def resolved_clip_high(self) -> float:
    return LOSS_DEFAULTS[self.loss][0] if self.clip_high is None else self.clip_high

  @property
  def resolved_aggregation(self) -> str:
    return LOSS_DEFAULTS[self.loss][1] if self.aggregation is None else self.aggregation

  @property
  def normalize_std(self) -> bool:
    return LOSS_DEFAULTS[self.loss][2]


class TrainState(NamedTuple):
  params: Any
  opt_state: Any
  step: jax.Array          # int32: optimizer steps taken (skipped ones excluded)
  skipped: jax.Array       # int32: updates skipped for a non-finite loss, gradient or result
  ref_params: Any = None   # frozen reference policy (only when kl_coef > 0)


def make_optimizer(cfg: UpdateConfig) -> optax.GradientTransformation:
  total = cfg.total_steps * cfg.ppo_epochs * cfg.minibatches
  warm = min(cfg.warmup_steps, total)
  if cfg.schedule == "constant":
    sched = optax.linear_schedule(0.0, cfg.lr, warm) if warm else optax.constant_schedule(cfg.lr)
    if warm:
      sched = optax.join_schedules([sched, optax.constant_schedule(cfg.lr)], [warm])
  else:
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(warm, 1), max(total, warm + 1),
                                               end_value=0.1 * cfg.lr)
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay, mu_dtype=jnp.float32))


def init_train_state(params, cfg: UpdateConfig) -> TrainState:
  """Cast params to the master dtype and build the optimizer state.

  The state owns fresh buffers (update_step donates it), so `params` stays usable.
  """
  dtype = jnp.dtype(cfg.master_dtype)
  copy = lambda tree: jax.tree_util.tree_map(lambda a: jnp.array(a, dtype=dtype, copy=True), tree)
  params = copy(params)
  ref = copy(params) if cfg.kl_coef > 0 else None
  return TrainState(params=params, opt_state=make_optimizer(cfg).init(params),
                    step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
                    ref_params=ref)


# Fraction of device memory the stored activations of one micro-batch may take before "auto"
# turns on per-layer rematerialisation.
REMAT_MEMORY_FRACTION = 0.25


def activation_bytes(model_config, rows: int, seq_len: int) -> int:
  """Rough bytes of the activations a backward pass keeps for `rows` x `seq_len` tokens
  without rematerialisation: per layer and token, the bf16 inputs of every projection and
  norm, the MLP's hidden activations, and the float32 + bf16 attention probabilities."""
  c = model_config
  q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  per_token = 2 * (6 * c.d_model + 2 * q + 2 * kv + 5 * c.d_ff) + 6 * c.n_heads * seq_len
  return int(rows * seq_len * c.n_layers * per_token)


def device_memory_bytes() -> int:
  """The default device's memory limit (16 GiB where the backend does not say)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  return int(stats.get("bytes_limit", 16 << 30))


def resolve_remat(policy: str, model_config, rows: int, seq_len: int) -> bool:
  """Whether the update recomputes each layer in the backward pass.

  "auto": yes when one micro-batch's activations (`activation_bytes`) would take more than
  REMAT_MEMORY_FRACTION of the device's memory (a 1.5B model at 16 x 1024 tokens on an H200,
  for one), no for small models and batches (the tests, the CPU demo), where recomputing
  only costs time.
  """
  if policy != "auto":
    return policy == "layer"
  need = activation_bytes(model_config, rows, seq_len)
  return need > REMAT_MEMORY_FRACTION * device_memory_bytes()


def check_batch_divisible(rows: int, cfg: UpdateConfig) -> None:
  """Rows must split evenly into minibatches x micro-batches (checked before compiling)."""
  if rows % (cfg.minibatches * cfg.micro_batches):
    raise ValueError(
        f"the batch has {rows} rows, which does not split into minibatches={cfg.minibatches} "
        f"x micro_batches={cfg.micro_batches}; choose values whose product divides {rows}")


def _split(tree, n):
  return jax.tree_util.tree_map(lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), tree)


def _take(tree, idx):
  return jax.tree_util.tree_map(lambda a: a[idx], tree)


def all_finite(tree) -> jax.Array:
  """A bool scalar: every leaf of `tree` is free of NaN and Inf."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
  return jnp.all(jnp.stack(leaves))


@functools.partial(jax.jit, static_argnames=("model_config", "cfg", "precision", "bin_edges"),
                   donate_argnames=("state",))
def update_step(state: TrainState, batch: TrainBatch, key: jax.Array, *, model_config,
                cfg: UpdateConfig, precision: Optional[Precision],
                bin_edges: tuple[int, ...] = DEFAULT_EDGES):
  """One RL update on a rollout batch. Returns (new_state, metrics of float32 scalars)."""
  rows = batch.inputs.shape[0]
  check_batch_divisible(rows, cfg)
  agg = cfg.resolved_aggregation
  max_tokens = cfg.max_tokens or batch.targets.shape[1]
  opt = make_optimizer(cfg)
  n_micro_total = cfg.minibatches * cfg.micro_batches
  lp_kwargs = dict(model_config=model_config, precision=precision, temperature=cfg.temperature,
                   chunk_size=cfg.chunk_size)
  remat = resolve_remat(cfg.remat, model_config, rows // n_micro_total, batch.inputs.shape[1])

  def no_grad_logprobs(params):
    chunks = _split(batch, n_micro_total)
    lp = jax.lax.map(lambda b: policy_logprobs(params, batch=b, **lp_kwargs)[0], chunks)
    return jax.lax.stop_gradient(lp.reshape(batch.targets.shape))

  # 1. The pre-update training forward.
  pre_logp = no_grad_logprobs(state.params)
  agree = agreement_metrics(batch.rollout_logprobs, pre_logp, batch.mask, bin_edges=bin_edges)
  is_w, is_metrics = importance_weights(pre_logp, batch.rollout_logprobs, batch.mask,
                                        method=cfg.is_method, cap=cfg.is_cap)
  old_logp = pre_logp if cfg.old_logp == "recompute" else batch.rollout_logprobs
  ref_logp = (no_grad_logprobs(state.ref_params) if cfg.kl_coef > 0
              else jnp.zeros_like(pre_logp))
  extra = dict(old_logp=old_logp, is_w=is_w, ref_logp=ref_logp)

  def micro_loss(params, mb, ex, den):
    logp, ent = policy_logprobs(params, batch=mb, remat=remat, **lp_kwargs)
    num, _, pm = ppo_clip_loss(logp, ex["old_logp"], mb.advantages, mb.mask,
                               clip_low=cfg.clip_low, clip_high=cfg.resolved_clip_high,
                               aggregation=agg, max_tokens=max_tokens,
                               is_weights=None if cfg.is_method == "none" else ex["is_w"])
    kl_num, _ = aggregate(kl_penalty(logp, ex["ref_logp"], mb.mask, estimator=cfg.kl_estimator),
                          mb.mask, agg, max_tokens=max_tokens)
    ent_num, _ = aggregate(ent, mb.mask, agg, max_tokens=max_tokens)
    loss = (num + cfg.kl_coef * kl_num - cfg.entropy_coef * ent_num) / den
    aux = dict(pg=num / den, kl=kl_num / den, entropy=ent_num / den,
               clip_frac_low=pm["clip_frac_low"] * pm["n_tokens"],
               clip_frac_high=pm["clip_frac_high"] * pm["n_tokens"],
               ratio_mean=pm["ratio_mean"] * pm["n_tokens"], n_tokens=pm["n_tokens"])
    return loss, aux

  grad_fn = jax.grad(micro_loss, has_aux=True)

  def minibatch_step(carry, mb_and_ex):
    st = carry
    mb, ex = mb_and_ex
    _, den = aggregate(jnp.zeros_like(mb.mask), mb.mask, agg, max_tokens=max_tokens)
    den = jnp.maximum(den, 1e-8)
    micro = _split((mb, ex), cfg.micro_batches)

    def acc(c, m):
      g, aux = grad_fn(st.params, m[0], m[1], den)
      loss_part = aux["pg"] + cfg.kl_coef * aux["kl"] - cfg.entropy_coef * aux["entropy"]
      c = (jax.tree_util.tree_map(jnp.add, c[0], g), c[1] + loss_part,
           jax.tree_util.tree_map(jnp.add, c[2], aux))
      return c, None

    zeros_g = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), st.params)
    aux0 = dict(pg=0.0, kl=0.0, entropy=0.0, clip_frac_low=0.0, clip_frac_high=0.0,
                ratio_mean=0.0, n_tokens=0.0)
    aux0 = jax.tree_util.tree_map(jnp.float32, aux0)
    (grads, loss, aux), _ = jax.lax.scan(acc, (zeros_g, jnp.float32(0), aux0), micro)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(grads)
    grads = jax.tree_util.tree_map(lambda g: jnp.where(ok, g, 0.0), grads)
    updates, new_opt = opt.update(grads, st.opt_state, st.params)
    new_params = optax.apply_updates(st.params, updates)
    ok = ok & all_finite(new_params) & all_finite(new_opt)  # the result, not only its inputs
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
    st = st._replace(params=keep(new_params, st.params), opt_state=keep(new_opt, st.opt_state),
                     step=st.step + ok.astype(jnp.int32),
                     skipped=st.skipped + (~ok).astype(jnp.int32))
    out = dict(loss=loss, grad_norm=grad_norm, finite=ok.astype(jnp.float32), **aux)
    return st, out

  def epoch(st, k):
    perm = jax.random.permutation(k, rows)
    shuffled = _split((_take(batch, perm), _take(extra, perm)), cfg.minibatches)
    return jax.lax.scan(minibatch_step, st, shuffled)

  skipped_before = state.skipped
  state, outs = jax.lax.scan(epoch, state, jax.random.split(key, cfg.ppo_epochs))
  outs = jax.tree_util.tree_map(lambda a: a.reshape(-1), outs)
  n_tok = jnp.maximum(outs["n_tokens"].sum(), 1.0)
  finite = outs["finite"] > 0
  n_finite = jnp.maximum(finite.sum(), 1)
  fmean = lambda a: jnp.where(finite, a, 0.0).sum() / n_finite
  metrics = dict(
      loss=fmean(outs["loss"]), pg_loss=fmean(outs["pg"]), kl=fmean(outs["kl"]),
      entropy=fmean(outs["entropy"]), grad_norm=fmean(outs["grad_norm"]),
      clip_frac_low=outs["clip_frac_low"].sum() / n_tok,
      clip_frac_high=outs["clip_frac_high"].sum() / n_tok,
      ratio_mean=outs["ratio_mean"].sum() / n_tok,
      skipped_updates=(state.skipped - skipped_before).astype(jnp.float32),
      optimizer_steps=state.step.astype(jnp.float32),
      is_frac_truncated=is_metrics["frac_truncated"], is_frac_dropped=is_metrics["frac_dropped"],
      is_mean_weight=is_metrics["mean_weight"])
  metrics.update({f"agree/{k}": v for k, v in agree.items()})
  return state, metrics
