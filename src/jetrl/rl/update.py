"""The jitted policy-gradient update: one rollout batch in, new params and metrics out.

Everything runs inside one `jit` under the training precision (`recipe.train`):
  1. the PPO ratio's "old" log-probs, log pi_old: with one epoch of one minibatch (the
     default `old_logp="auto"` resolves to "same_forward" there) the differentiated forward's
     own, detached, and no other forward runs; otherwise (old_logp="recompute") a no-grad
     training forward over the whole batch before the update (`pre_update`). The
     rollout/training agreement metrics compare that forward's log-probs with the rollout's.
     The loss is the entry `cfg.loss` of the table `jetrl.rl.objective.LOSS_SPECS`, its terms
     (policy loss, entropy, KL) combined by `jetrl.rl.objective.total_loss`; for the PPO
     losses (grpo, dapo, dr_grpo) the per-token policy loss is

       l_t = -w_t * min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)
       r_t = pi_theta(y_t) / pi_old(y_t)                    (the PPO ratio; gradient through pi_theta)
       w_t = 1                                              (is_method="none")
             min(pi_old(y_t) / pi_rollout(y_t), C)          ("tis"; "mis": 1 inside [1/C, C], else 0)

     with w_t a constant (stop-gradient): the rollout/training mismatch is corrected once, by
     w, and the policy change once, by r. old_logp="rollout" takes pi_rollout as the old
     policy (r_t = pi_theta / pi_rollout, which already holds the mismatch), so it admits no
     IS correction: the pair is a ConfigError. old_logp="same_forward" takes log pi_old from
     the differentiated forward itself (one epoch of one minibatch only), so r_t = 1 exactly
     and the update runs one forward fewer: under "recompute" the pre-update forward is
     another program, and where its rounding differs from the differentiated one's (under FP8
     a few tokens in a thousand beyond the clip range, docs/precision_study.md) r_t != 1
     before any update, and a negative-advantage token with r_t > 1 + clip_high is not clipped: its gradient is
     scaled by r_t. GSPO and CISPO (`jetrl.rl.ratio_losses`) take
     the same r and w, GSPO as a sequence ratio, CISPO as a clipped detached weight;
  2. `ppo_epochs` passes over `minibatches` shuffled minibatches (`epoch`), each split into
     `micro_batches` for gradient accumulation (`accumulate`); every (micro-)loss returns
     (numerator, denominator) and the denominators are fixed per minibatch, so accumulation is
     exact;
  3. one optimizer step per minibatch (`minibatch_step`) with the run's optimizer
     (`jetrl.rl.optimizer.make_optimizer`): a step whose loss, gradients, update, new params or
     new optimizer state holds a NaN or Inf is skipped (params and optimizer state stay as they
     were) and counted. The RL loop stops a run whose updates are all skipped for several steps
     in a row (docs/reliability.md).

The pieces are module-level functions of a static `StepSpec`; `jit_update_step` is the one
place they are jitted (`update_step`, and `jetrl.parallel`'s sharded step, which adds out
shardings).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jetrl.kernels import Device, KernelConfig, resolve_plan
from jetrl.models.layers import activation_dtype
from jetrl.models.lora import LoraConfig, attach
from jetrl.precision import Precision
from jetrl.rl.agreement import DEFAULT_EDGES, agreement_metrics
from jetrl.rl.batch import TrainBatch, policy_logprobs
from jetrl.rl.correction import importance_weights
from jetrl.rl.losses import aggregate
from jetrl.rl import metrics as names
from jetrl.rl.objective import (
  TOKEN_METRICS,
  has_reference,
  has_router_aux,
  loss_terms,
  term_keys,
  total_loss,
)
from jetrl.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from jetrl.rl.remat import resolve_remat
from jetrl.rl.routing import ROUTE_SUMS, load_balancing_loss, route_metrics, route_sums
from jetrl.rl.state import TrainState
from jetrl.rl.update_config import UpdateConfig


def check_batch_divisible(rows: int, cfg: UpdateConfig) -> None:
  """Rows must split evenly into minibatches x micro-batches (checked before compiling)."""
  if rows % (cfg.minibatches * cfg.micro_batches):
    raise ValueError(
      f"the batch has {rows} rows, which does not split into minibatches={cfg.minibatches} "
      f"x micro_batches={cfg.micro_batches}; choose values whose product divides {rows}"
    )


class StepSpec(NamedTuple):
  """The static context of one update, shared by its pieces."""

  model_config: Any
  cfg: UpdateConfig
  precision: Optional[Precision]
  temperature: float
  remat: bool
  max_tokens: int
  lora: Optional[LoraConfig] = None
  split_tokens: Any = None  # jetrl.parallel's Layout.token_split on a mesh
  top_k: Optional[int] = None  # the sampler's truncation (jetrl.precision.truncation)
  top_p: float = 1.0
  plan: Any = None  # the kernels (jetrl.kernels.Plan), resolved for the precision

  def policy(self, params, frozen):
    """The params the model reads: `params`, or a LoRA run's adapters on its frozen base."""
    if self.lora is None:
      return params
    if frozen is None:
      raise ValueError("a LoRA update needs the frozen base (init_lora_train_state)")
    return attach(frozen, params, self.lora)

  def compares_routes(self, batch: TrainBatch) -> bool:
    """Whether the rollout's expert choices are compared with this forward's (a mixture of
    experts whose batch carries them: the routing agreement metrics, `jetrl.rl.routing`)."""
    return self.model_config.moe and batch.rollout_routes is not None

  def logprobs(self, params, batch: TrainBatch, remat: bool = False, routing: bool = False):
    return policy_logprobs(
      params,
      self.model_config,
      batch,
      self.precision,
      temperature=self.temperature,
      chunk_size=self.cfg.chunk_size,
      remat=remat,
      split_tokens=self.split_tokens,
      top_k=self.top_k,
      top_p=self.top_p,
      plan=self.plan,
      routing=routing,
    )

  def aggregate(self, per_token, mask):
    return aggregate(per_token, mask, self.cfg.resolved_aggregation, max_tokens=self.max_tokens)


def _split(tree, n):
  return jax.tree_util.tree_map(lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), tree)


def _take(tree, idx):
  return jax.tree_util.tree_map(lambda a: a[idx], tree)


def no_grad_logprobs(params, batch: TrainBatch, spec: StepSpec, routes: bool = False):
  """Training-forward log-probs of the whole batch, in micro-batch chunks, without gradient;
  with `routes`, a pair of them and the routing agreement's sums (`route_sums`)."""
  n = spec.cfg.minibatches * spec.cfg.micro_batches

  def one(b):
    if not routes:
      return spec.logprobs(params, b)[0]
    logp, _, routing = spec.logprobs(params, b, routing=True)
    return logp, route_sums(b.rollout_routes, routing, b.mask)

  out = jax.lax.map(one, _split(batch, n))
  lp = jax.lax.stop_gradient((out[0] if routes else out).reshape(batch.targets.shape))
  if not routes:
    return lp
  return lp, jax.tree_util.tree_map(lambda a: jax.lax.stop_gradient(a.sum()), out[1])


def pre_update(state: TrainState, batch: TrainBatch, spec: StepSpec, bin_edges):
  """The pre-update training forward: (per-row extras for the loss, agreement metrics, IS
  metrics). The extras are the PPO ratio's old log-probs, the IS weights
  min(pi_old / pi_rollout, C) (or their masked form) and, with a reference policy, its
  log-probs. Where the old log-probs come from the differentiated forward itself
  (`same_forward`) no pre-update forward runs: `micro_loss` forms the old log-probs and IS
  weights, and both metrics are None here (`train_step` computes them after the step from
  that forward's log-probs, `forward_metrics`)."""
  cfg = spec.cfg
  if cfg.resolved_old_logp == "same_forward":
    extra, agree, is_metrics = {}, None, None
  else:
    routes = spec.compares_routes(batch)
    pre_logp = no_grad_logprobs(spec.policy(state.params, state.frozen), batch, spec, routes)
    if routes:
      pre_logp, sums = pre_logp
    agree, is_w, is_metrics = forward_metrics(pre_logp, batch, cfg, bin_edges)
    if routes:
      agree = dict(agree, **route_metrics(sums))
    old_logp = batch.rollout_logprobs if cfg.resolved_old_logp == "rollout" else pre_logp
    extra = dict(old_logp=old_logp, is_w=is_w)
  if has_reference(cfg) and spec.lora is not None:  # the frozen base is the reference
    extra["ref_logp"] = no_grad_logprobs(state.frozen, batch, spec)
  elif has_reference(cfg):
    if state.ref_params is None:
      raise ValueError(
        "kl_coef > 0 needs the reference params in the train state (init_train_state with "
        "the same UpdateConfig keeps a copy)"
      )
    extra["ref_logp"] = no_grad_logprobs(state.ref_params, batch, spec)
  return extra, agree, is_metrics


def forward_metrics(train_logp, batch: TrainBatch, cfg: UpdateConfig, bin_edges):
  """(agreement metrics, IS weights, IS metrics) of a training forward's log-probs against
  the rollout's."""
  agree = agreement_metrics(batch.rollout_logprobs, train_logp, batch.mask, bin_edges=bin_edges)
  is_w, is_metrics = importance_weights(
    train_logp,
    batch.rollout_logprobs,
    batch.mask,
    method=cfg.is_method,
    cap=cfg.is_cap,
    cap_low=cfg.is_cap_low,
  )
  return agree, is_w, is_metrics


def micro_loss(params, mb: TrainBatch, extra: dict, den, spec: StepSpec, frozen=None):
  """(loss, (aux, log-probs)) of one micro-batch; `den` is its minibatch's fixed denominator;
  `frozen`, a LoRA run's base (no gradient: `params` are the adapters). The log-probs
  (detached) are this forward's under `same_forward`, else None."""
  same_forward = spec.cfg.resolved_old_logp == "same_forward"
  compare = same_forward and spec.compares_routes(mb)
  routing = compare or has_router_aux(spec.cfg)
  out = spec.logprobs(spec.policy(params, frozen), mb, remat=spec.remat, routing=routing)
  logp, ent = out[:2]
  own = None
  if same_forward:
    # The ratio's denominator from this very forward (the loss stops its gradient): exactly 1
    # on the one step, where a separate pre-update program may round a token differently;
    # the IS weights compare the same values with the rollout's.
    own = jax.lax.stop_gradient(logp)
    is_w, _ = importance_weights(
      own,
      mb.rollout_logprobs,
      mb.mask,
      method=spec.cfg.is_method,
      cap=spec.cfg.is_cap,
      cap_low=spec.cfg.is_cap_low,
    )
    extra = dict(extra, old_logp=own, is_w=is_w)
  nums, pm = loss_terms(spec.cfg, logp, ent, mb.advantages, mb.mask, extra, spec.max_tokens)
  if has_router_aux(spec.cfg):  # per micro-batch, their mean over the minibatch
    lb = load_balancing_loss(out[2], mb.attention_mask)
    nums["router_aux"] = lb * den / spec.cfg.micro_batches
  aux = {k: v / den for k, v in nums.items()}
  aux.update({k: pm[k] * pm["n_tokens"] for k in TOKEN_METRICS}, n_tokens=pm["n_tokens"])
  if compare:  # the routing of the forward the ratio's old policy comes from
    aux.update(route_sums(mb.rollout_routes, jax.lax.stop_gradient(out[2]), mb.mask))
  return total_loss(nums, spec.cfg) / den, (aux, own)


def accumulate(params, mb: TrainBatch, extra: dict, spec: StepSpec, frozen=None):
  """(gradients, loss, aux) of a minibatch, summed over its micro-batches; under
  `same_forward` aux["logp"] holds the differentiated forward's log-probs [rows, T]
  (detached, the minibatch's row order)."""
  cfg = spec.cfg
  _, den = spec.aggregate(jnp.zeros_like(mb.mask), mb.mask)
  den = jnp.maximum(den, 1e-8)
  grad_fn = jax.grad(micro_loss, has_aux=True)

  def add(carry, micro):
    g, (aux, own) = grad_fn(params, micro[0], micro[1], den, spec, frozen)
    return (
      jax.tree_util.tree_map(jnp.add, carry[0], g),
      carry[1] + total_loss(aux, cfg),
      jax.tree_util.tree_map(jnp.add, carry[2], aux),
    ), own

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  keys = term_keys(cfg) + TOKEN_METRICS + ("n_tokens",)
  if cfg.resolved_old_logp == "same_forward" and spec.compares_routes(mb):
    keys += ROUTE_SUMS
  aux0 = {k: jnp.float32(0.0) for k in keys}
  (grads, loss, aux), own = jax.lax.scan(
    add, (zeros, jnp.float32(0), aux0), _split((mb, extra), cfg.micro_batches)
  )
  if own is not None:
    aux = dict(aux, logp=own.reshape(mb.targets.shape))
  return grads, loss, aux


def minibatch_step(
  state: TrainState, mb_and_extra, spec: StepSpec, opt: optax.GradientTransformationExtraArgs
):
  """One optimizer step on a minibatch; skipped (and counted) when anything is non-finite."""
  grads, loss, aux = accumulate(state.params, *mb_and_extra, spec, state.frozen)
  updates, opt_state = opt.update(grads, state.opt_state, state.params, value=loss)
  ok = opt_state.last_ok
  new_params = optax.apply_updates(state.params, updates)
  params = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new_params, state.params)
  out = dict(loss=loss, grad_norm=optax.tree.norm(grads), finite=ok.astype(jnp.float32), **aux)
  return state._replace(params=params, opt_state=opt_state), out


def epoch(state: TrainState, key, batch: TrainBatch, extra: dict, spec: StepSpec, opt):
  """A pass over the batch in shuffled minibatches. Under `same_forward` (one minibatch)
  outs["logp"] holds the differentiated forward's log-probs [rows, T] in the batch's order."""
  rows = batch.inputs.shape[0]
  perm = jax.random.permutation(key, rows)
  shuffled = _split((_take(batch, perm), _take(extra, perm)), spec.cfg.minibatches)
  step = functools.partial(minibatch_step, spec=spec, opt=opt)
  state, outs = jax.lax.scan(step, state, shuffled)
  if "logp" in outs:
    own = outs["logp"].reshape(batch.targets.shape)
    outs = dict(outs, logp=jnp.zeros_like(own).at[perm].set(own))
  return state, outs


def summarize(
  outs: dict, state: TrainState, skipped_before, agree: dict, is_metrics: dict, learning_rate
) -> dict:
  """The update's metrics (float32 scalars): loss terms averaged over the applied steps,
  token-weighted clip fractions and ratio, skip counts, agreement and IS metrics."""
  outs = jax.tree_util.tree_map(lambda a: a.reshape(-1), outs)
  n_tok = jnp.maximum(outs["n_tokens"].sum(), 1.0)
  finite = outs["finite"] > 0
  n_finite = jnp.maximum(finite.sum(), 1)
  fmean = lambda a: jnp.where(finite, a, 0.0).sum() / n_finite
  metrics = dict(
    loss=fmean(outs["loss"]),
    pg_loss=fmean(outs["pg"]),
    entropy=fmean(outs["entropy"]),
    grad_norm=fmean(outs["grad_norm"]),
    clip_frac_low=outs["clip_frac_low"].sum() / n_tok,
    clip_frac_high=outs["clip_frac_high"].sum() / n_tok,
    ratio_mean=outs["ratio_mean"].sum() / n_tok,
    skipped_updates=(state.skipped - skipped_before).astype(jnp.float32),
    optimizer_steps=state.step.astype(jnp.float32),
    learning_rate=jnp.asarray(learning_rate, jnp.float32),
    is_frac_truncated=is_metrics["frac_truncated"],
    is_frac_dropped=is_metrics["frac_dropped"],
    is_frac_seq_dropped=is_metrics["frac_seq_dropped"],
    is_mean_weight=is_metrics["mean_weight"],
  )
  if "kl" in outs:  # only against a real reference policy (kl_coef > 0)
    metrics["kl"] = fmean(outs["kl"])
  if "router_aux" in outs:  # a mixture of experts' load balancing (router_aux_coef > 0)
    metrics[names.ROUTER_AUX_LOSS] = fmean(outs["router_aux"])
  metrics.update({names.agree(k): v for k, v in agree.items()})
  return metrics


def train_step(
  state: TrainState,
  batch: TrainBatch,
  key: jax.Array,
  *,
  model_config,
  cfg: UpdateConfig,
  optimizer: OptimizerConfig = OptimizerConfig(),
  total_steps: int = 1000,
  precision: Optional[Precision],
  temperature: float = 1.0,
  bin_edges: tuple[int, ...] = DEFAULT_EDGES,
  lora: Optional[LoraConfig] = None,
  split_tokens: Any = None,
  top_k: Optional[int] = None,
  top_p: float = 1.0,
  kernels: Union[KernelConfig, Device, None] = None,
):
  """One RL update on a rollout batch (not jitted: see `update_step`).

  optimizer, total_steps: the run's optimizer and its length in optimizer steps (the
    schedule's horizon, `UpdateConfig.optimizer_steps`).
  temperature: the sampling temperature the rollout log-probs were recorded at.
  top_k, top_p: the sampling's top-k / top-p: the training forward's log-probs are those of
    the distribution truncated by them from its own logits, as the rollout's were recorded
    (`jetrl.precision.truncation`; docs/numerics.md, "Log-probs under top-k / top-p").
  lora: a LoRA run's config (rank > 0): `state` is `init_lora_train_state`'s, the adapters
    are trained on its frozen base.
  kernels: the kernel settings (`jetrl.kernels.KernelConfig`, a run's `--kernels.*`; None: the
    environment's) for the device traced for, or a `jetrl.kernels.Device` (a compile-only
    target's, `jetrl.aot`); the plan (`jetrl.kernels.resolve_plan`) is resolved from them once
    per trace, and says the device's memory to the rematerialisation choice.
  split_tokens: on a mesh, `Layout.token_split`: each layer's activations keep their rows on
    the devices that hold the batch's rows (`jetrl.parallel.sharded_update_step` passes it).
  Returns (new_state, metrics of float32 scalars; `learning_rate` is the rate of this
  update's first optimizer step).
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0 for the update, got {temperature!r}")
  if has_router_aux(cfg) and not model_config.moe:
    raise ValueError(
      f"router_aux_coef={cfg.router_aux_coef} is a mixture of experts' load-balancing loss; "
      f"this model (family {model_config.family!r}) has none: set it to 0"
    )
  rows = batch.inputs.shape[0]
  check_batch_divisible(rows, cfg)
  n_micro = cfg.minibatches * cfg.micro_batches
  plan = resolve_plan(precision, kernels)
  spec = StepSpec(
    model_config=model_config,
    cfg=cfg,
    precision=precision,
    temperature=temperature,
    remat=resolve_remat(
      cfg.remat,
      model_config,
      rows // n_micro,
      batch.inputs.shape[1],
      flash=plan.use_flash(
        batch.inputs.shape[1], model_config.head_dim, activation_dtype(precision, state.params)
      ),
      memory_bytes=plan.device.memory_bytes,
    ),
    max_tokens=cfg.max_tokens or batch.targets.shape[1],
    lora=lora if lora is not None and lora.enabled else None,
    split_tokens=split_tokens,
    top_k=top_k,
    top_p=top_p,
    plan=plan,
  )
  opt = make_optimizer(optimizer, total_steps)
  learning_rate = learning_rate_schedule(optimizer, total_steps)(state.step)
  extra, agree, is_metrics = pre_update(state, batch, spec, bin_edges)
  skipped_before = state.skipped
  run_epoch = functools.partial(epoch, batch=batch, extra=extra, spec=spec, opt=opt)
  state, outs = jax.lax.scan(run_epoch, state, jax.random.split(key, cfg.ppo_epochs))
  if agree is None:  # same_forward: the metrics of the differentiated forward (one epoch)
    own = outs.pop("logp").reshape(batch.targets.shape)
    agree, _, is_metrics = forward_metrics(own, batch, cfg, bin_edges)
    if "route_n" in outs:  # its routing against the rollout's (one optimizer step)
      agree = dict(agree, **route_metrics({k: outs.pop(k).sum() for k in ROUTE_SUMS}))
  return state, summarize(outs, state, skipped_before, agree, is_metrics, learning_rate)


STATIC_ARGNAMES = (
  "model_config",
  "cfg",
  "optimizer",
  "total_steps",
  "precision",
  "temperature",
  "bin_edges",
  "lora",
  "split_tokens",
  "top_k",
  "top_p",
  "kernels",
)


def jit_update_step(out_shardings: Any = None):
  """`train_step` jitted, the train state donated; `out_shardings` (jetrl.parallel) pins the
  new state's and the metrics' shardings."""
  kw = {} if out_shardings is None else {"out_shardings": out_shardings}
  return jax.jit(train_step, static_argnames=STATIC_ARGNAMES, donate_argnames=("state",), **kw)


update_step = jit_update_step()
