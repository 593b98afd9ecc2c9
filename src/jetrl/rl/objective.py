"""The update's objective: the table of policy losses and the total loss built from its terms.

`LOSS_SPECS` maps each name `UpdateConfig.loss` accepts to a `LossSpec`: the policy-loss
function and the defaults a config leaves to it (clip range, aggregation, advantage scaling).
A new loss is one entry here; the config's choices, its help and the update follow.

The total loss of a micro-batch is one expression of its terms (`total_loss`):

  loss = pg - entropy_coef * entropy (+ kl_coef * kl, with a reference policy)
              (+ router_aux_coef * router_aux, a mixture of experts' load balancing)

applied to the terms' numerators in the micro-batch loss (whose gradient the update takes)
and to their normalised values in the minibatch's reported loss, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import chex

from jetrl.config import ConfigError
from jetrl.rl.advantages import ADVANTAGE_SPECS
from jetrl.rl.losses import aggregate, kl_penalty, ppo_clip_loss
from jetrl.rl.ratio_losses import CISPO_CLIP, GSPO_CLIP, cispo_loss, gspo_loss

# The metrics of a policy loss that the update sums over micro-batches weighted by tokens.
TOKEN_METRICS = ("clip_frac_low", "clip_frac_high", "ratio_mean")


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """One policy loss of the table.

  function: (logp, old_logp, advantages, mask, *, clip_low, clip_high, aggregation,
    max_tokens, is_weights) -> (num, den, metrics), with `TOKEN_METRICS` and n_tokens among
    the metrics (`jetrl.rl.losses.ppo_clip_loss` is the model). A knob of one loss alone is
    bound into it (functools.partial) or, when a run should set it, an `UpdateConfig` field.
  clip_low, clip_high: the default clip range [1 - clip_low, 1 + clip_high].
  aggregation: the default token aggregation (`jetrl.rl.losses.AGGREGATIONS`).
  advantage: the default advantage, an entry of `jetrl.rl.advantages.ADVANTAGE_SPECS`.
  detached_ratio: the clipped ratio is a constant weight (CISPO), so clip_low may be 1 (no
    lower bound); otherwise the gradient flows through it and clip_low must be < 1.
  summary: the defaults in words, for the `update.loss` help.
  group_std_ok: the loss admits an advantage divided by each group's std (Dr.GRPO is defined
    by removing it).
  """

  function: Callable[..., tuple[chex.Array, chex.Array, dict]]
  clip_low: float
  clip_high: float
  aggregation: str
  advantage: str
  summary: str
  detached_ratio: bool = False
  group_std_ok: bool = True


LOSS_SPECS: Mapping[str, LossSpec] = {
  "grpo": LossSpec(
    ppo_clip_loss,
    0.2,
    0.2,
    "seq_mean_token_mean",
    "grpo",
    "clip 0.2, mean over tokens then sequences",
  ),
  "dapo": LossSpec(ppo_clip_loss, 0.2, 0.28, "token", "grpo", "clip-high 0.28, token mean"),
  "dr_grpo": LossSpec(
    ppo_clip_loss,
    0.2,
    0.2,
    "constant",
    "dr_grpo",
    "constant normaliser, no std scaling",
    group_std_ok=False,
  ),
  "gspo": LossSpec(
    gspo_loss,
    *GSPO_CLIP,
    "seq_mean_token_mean",
    "grpo",
    "sequence-level ratio clipped to [1 - 3e-4, 1 + 4e-4], mean over sequences",
  ),
  "cispo": LossSpec(
    cispo_loss,
    *CISPO_CLIP,
    "token",
    "grpo",
    "clipped detached IS weight on every token's log-prob, clip-high 0.28, no lower clip, "
    "token mean",
    detached_ratio=True,
  ),
}
LOSSES = tuple(LOSS_SPECS)
LOSS_HELP = "Policy loss (its defaults: {}).".format(
  "; ".join(f"{name} {spec.summary}" for name, spec in LOSS_SPECS.items())
)
ADVANTAGE_HELP = "Advantage estimator (none: the loss's own, {}): {}.".format(
  "; ".join(
    f"{kind} for {', '.join(n for n, spec in LOSS_SPECS.items() if spec.advantage == kind)}"
    for kind in dict.fromkeys(spec.advantage for spec in LOSS_SPECS.values())
  ),
  "; ".join(f"{name} {spec.summary}" for name, spec in ADVANTAGE_SPECS.items()),
)


class LossFields:
  """The loss's part of `jetrl.rl.UpdateConfig` (a base class of it): the fields left None
  resolved from the entry `loss` of the table, and the check that depends on the loss."""

  @property
  def loss_spec(self) -> LossSpec:
    return LOSS_SPECS[self.loss]

  @property
  def resolved_clip_low(self) -> float:
    return self.loss_spec.clip_low if self.clip_low is None else self.clip_low

  @property
  def resolved_clip_high(self) -> float:
    return self.loss_spec.clip_high if self.clip_high is None else self.clip_high

  @property
  def resolved_aggregation(self) -> str:
    return self.loss_spec.aggregation if self.aggregation is None else self.aggregation

  @property
  def resolved_advantage(self) -> str:
    """The advantage estimator: `advantage`, or the loss's own when it is None."""
    return self.loss_spec.advantage if self.advantage is None else self.advantage

  def check_loss(self) -> None:
    """clip_low < 1 where the clipped ratio carries the gradient (all losses but cispo); no
    group-std advantage for a loss defined without one (dr_grpo)."""
    if self.resolved_clip_low == 1.0 and not self.loss_spec.detached_ratio:
      raise ConfigError(
        "clip_low",
        f"must be < 1 (a ratio clipped at 0 has no gradient), got 1.0 for loss {self.loss!r}",
      )
    if ADVANTAGE_SPECS[self.resolved_advantage].group_std and not self.loss_spec.group_std_ok:
      raise ConfigError(
        "advantage",
        f"{self.resolved_advantage!r} divides each group by its std, and loss={self.loss!r} is "
        "defined by leaving that scaling out (it weights prompts by their difficulty); for a "
        "constant normaliser with group-std advantages use loss='grpo' with "
        "aggregation='constant', or pick another advantage",
      )


def has_reference(cfg: Any) -> bool:
  """Whether the update has a reference policy: the KL penalty is on (kl_coef > 0). Without
  one, no KL is computed and the metrics have no `kl`."""
  return cfg.kl_coef > 0


def has_router_aux(cfg: Any) -> bool:
  """Whether the loss has the load-balancing term (router_aux_coef > 0; a mixture of experts
  only: `jetrl.rl.update` refuses it for a dense model)."""
  return getattr(cfg, "router_aux_coef", 0.0) > 0


def term_keys(cfg: Any) -> tuple[str, ...]:
  """The loss's terms (`total_loss`), in the update's metrics as pg_loss, entropy, kl,
  router_aux_loss."""
  return (
    ("pg", "entropy")
    + (("kl",) if has_reference(cfg) else ())
    + (("router_aux",) if has_router_aux(cfg) else ())
  )


def total_loss(terms: Mapping[str, chex.Array], cfg: Any) -> chex.Array:
  """The loss from its terms (numerators or normalised values: it is linear in them)."""
  loss = terms["pg"] - cfg.entropy_coef * terms["entropy"]
  if has_reference(cfg):
    loss = loss + cfg.kl_coef * terms["kl"]
  if has_router_aux(cfg):
    loss = loss + cfg.router_aux_coef * terms["router_aux"]
  return loss


def loss_terms(
  cfg: Any,
  logp: chex.Array,
  entropy: chex.Array,
  advantages: chex.Array,
  mask: chex.Array,
  extra: Mapping[str, chex.Array],
  max_tokens: int,
) -> tuple[dict[str, chex.Array], dict[str, chex.Array]]:
  """(numerators of the terms `term_keys(cfg)`, the policy loss's metrics) of a micro-batch.

  cfg: the `UpdateConfig`; extra: the pre-update arrays of `jetrl.rl.update.pre_update`
  (old_logp, is_w and, with a reference policy, ref_logp)."""
  agg = cfg.resolved_aggregation
  num, _, metrics = LOSS_SPECS[cfg.loss].function(
    logp,
    extra["old_logp"],
    advantages,
    mask,
    clip_low=cfg.resolved_clip_low,
    clip_high=cfg.resolved_clip_high,
    aggregation=agg,
    max_tokens=max_tokens,
    is_weights=None if cfg.is_method == "none" else extra["is_w"],
  )
  terms = dict(pg=num, entropy=aggregate(entropy, mask, agg, max_tokens=max_tokens)[0])
  if has_reference(cfg):
    kl = kl_penalty(logp, extra["ref_logp"], mask, estimator=cfg.kl_estimator)
    terms["kl"] = aggregate(kl, mask, agg, max_tokens=max_tokens)[0]
  return terms, metrics
