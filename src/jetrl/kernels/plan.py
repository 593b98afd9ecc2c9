"""`Plan`: which implementation runs each block of the model, resolved once.

A plan is resolved (`resolve_plan`) when the sampler or the update is built, from the precision,
the device the program is traced for and the kernel settings (`jetrl.kernels.device`), and is
passed beside the precision as a static argument: a frozen, hashable dataclass, so `jit`
caches on it and nothing the traced code reads is global. The model's layers call its
methods (`linear`, `norm`, `norm_linear`, `mlp`, `head`, ...), never a kernel.

Per block (`Blocks`), the implementation it runs:

  linear            "plain" (no precision: one matmul), "exact" (the batch-invariant forward's
                    exact sums), "invariant" (the batch-invariant forward on a GPU: fixed-tile
                    Pallas GEMMs, kernels/invariant_gemm.py) or the fprop's GEMM backend ("xla", "cublaslt", "pallas", "pallas_interpret";
                    each GEMM may still fall back for a shape its kernel cannot take)
  norm_linear, mlp  "fused" (compiled for a GPU under a blockwise training precision: the
                    norm's and SwiGLU's kernels write the GEMMs' FP8 groups, where the shapes
                    are whole tiles), "unfused", "exact" or "invariant" (the norm's fixed-order
                    float32 sum of squares, one program a row, then the invariant GEMMs)
  attention         "flash" (the Pallas flash-attention kernel, for whole tiles), "xla", "exact",
                    "invariant" (one key-block size and merge order for every call; the
                    flash kernels' backward)
  decode_attention  "kernel" (compiled for a GPU: one Pallas kernel over the cache where its
                    shapes serve, with the bias, RoPE and cache write where q / k / v come
                    fused, and the whole decode step in the fused kernels where they apply;
                    else XLA's reductions), "xla", "exact" (a gridded cache: `grids_cache`),
                    "invariant" (the attention block's kernel over the cache, read in place)
  head              "dot16" (the 16-bit head with its backward in that dtype), "xla", "exact",
                    "invariant" (kernels/invariant_head.py: the fixed-tile bf16 GEMM and the
                    exact log-softmax)

`jet_exact` resolves to "exact" everywhere on the CPU and to "invariant" on a GPU: there the
attention (training forward, prefill and decode step alike) is kernels/invariant_attention.py,
over a plain KV cache.

The numbers are the same whichever implementation runs, except where docs/numerics.md says
the float32 sums run in another order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import math

import jax
import jax.numpy as jnp

from jetrl.kernels import attention as _attn
from jetrl.kernels import backend as _backend
from jetrl.kernels import cpu_kernels as _cpu_kernels
from jetrl.kernels import exact_gemm as _exact_gemm
from jetrl.kernels import exact_ops
from jetrl.kernels import flash as _flash
from jetrl.kernels import gemms as _gemms
from jetrl.kernels import head as _head
from jetrl.kernels import invariant_attention as _inv_attn
from jetrl.kernels import invariant_gemm as _inv_gemm
from jetrl.kernels import invariant_head as _inv_head
from jetrl.kernels import invariant_norm as _inv_norm
from jetrl.kernels import mlp as _mlp
from jetrl.kernels import swiglu_kernel as _sk
from jetrl.kernels.cache_step import CacheStep
from jetrl.kernels.device import Device, KernelConfig, current_device
from jetrl.kernels.norm_kernel import rms_norm_cd
from jetrl.precision import truncation as _truncation
from jetrl.precision.kv_cache import round_kv
from jetrl.precision.formats import format_dtype
from jetrl.precision.linear import linear as _precision_linear
from jetrl.precision.recipes import Precision
from jetrl.precision.weights import QuantizedInput, QuantizedWeight
from jetrl.precision.xla_gemms import XlaGemms


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The implementation of each block (the module doc's table)."""

  linear: str
  norm_linear: str
  mlp: str
  attention: str
  decode_attention: str
  head: str


@dataclasses.dataclass(frozen=True)
class Plan(XlaGemms):
  """Which kernels compute `precision`'s numbers on `device` (static under jit).

  It is also what `jetrl.precision.linear` computes its GEMMs with (`xla_gemms.XlaGemms`'s
  methods, on the kernels the device and each Fp8Gemm's `gemm_backend` pick)."""

  precision: Optional[Precision]
  device: Device
  blocks: Blocks

  @property
  def exact(self) -> bool:
    """The batch-invariant forward: every block's exact or invariant implementation."""
    return self.blocks.linear in _INVARIANT

  @property
  def gpu(self) -> bool:
    return self.device.gpu

  @property
  def interpret(self) -> bool:
    """A GPU program run here: its Pallas kernels interpreted (`Device.interpret`)."""
    return self.device.interpret

  # The GEMMs of `jetrl.precision.linear` (xla_gemms.XlaGemms's interface).

  def k_major(self, g, exact: bool) -> bool:
    if exact:  # the invariant GEMM reads the weight K-major, the exact sums [K, N]
      return self.blocks.linear == "invariant"
    return _backend.wants_k_major(g, self.device)

  def matmul_cd(self, a, b, cd):
    return _gemms.matmul_cd(a, b, cd, self.device)

  @property
  def exact_kernels(self) -> bool:
    """Whether the batch-invariant blocks' exact sums run in the CPU kernels on the plan's
    device (`cpu_kernels.usable`: the same bits as XLA's path, faster)."""
    return _cpu_kernels.usable(self.device)

  def fprop(self, x2, w: QuantizedWeight, g, cd, exact: bool):
    if exact and self.blocks.linear == "invariant":  # one tile configuration, K in order
      return _inv_gemm.fp8_fprop(x2, w, g, cd, interpret=self.device.interpret_kernels)
    if exact:  # batch-invariant: exact float64 block sums in a fixed order
      return _exact_gemm.fp8_fprop(x2, *w.kn(), g, kernel=self.exact_kernels)
    return _gemms.fprop(x2, w, g, cd, self.device)

  def fprop_quantized(self, x: QuantizedInput, w: QuantizedWeight, g, cd):
    return _gemms.fprop_quantized(x, w, g, cd, self.device)

  def dgrad(self, dy2, w: QuantizedWeight, g, cd):
    return _gemms.dgrad(dy2, w, g, cd, self.device)

  def wgrad(self, x2, dy2, g, out_dtype):
    return _gemms.wgrad(x2, dy2, g, out_dtype, self.device)

  # The blocks the model calls.

  def linear(self, x, w):
    """x @ w under the plan's precision (`jetrl.precision.linear`), on its kernels."""
    return _precision_linear(x, w, self.precision, gemms=self)

  def weight_k_major(self, g) -> bool:
    """Whether the plan's own forward quantizes a weight for g K-major (as `linear` does)."""
    return self.k_major(g, self.blocks.linear in _INVARIANT)

  def with_gemm_scales(self, w: QuantizedWeight, g) -> QuantizedWeight:
    """A weight quantized once with its scales laid out as its GEMM reads them."""
    return _gemms.with_gemm_scales(w, g, self.device)

  def takes_quantized_input(self, g, m: int, n: int, k: int, out_dtype) -> bool:
    return _gemms.takes_quantized_input(g, m, n, k, out_dtype, self.device)

  def fused_mlp(self, m: int, wg, wu, wd) -> bool:
    """Whether the MLP of m token rows runs in the fused kernels (`kernels.mlp.applies`)."""
    return self.blocks.mlp == "fused" and _mlp.applies(m, wg, wu, wd, self.precision, self.device)

  def fused_norm(self, m: int, norm_weight, w) -> bool:
    """Whether the RMSNorm before w writes w's FP8 groups itself (`kernels.mlp.norm_applies`)."""
    return self.blocks.norm_linear == "fused" and _mlp.norm_applies(
      m, norm_weight, w, self.precision, self.device
    )

  def mlp(self, x, wg, wu, wd, norm=None):
    """The SwiGLU MLP in the fused kernels (where `fused_mlp` holds), norm = (weight, eps)."""
    return _mlp.swiglu_mlp(x, wg, wu, wd, self.precision, self.device, norm=norm)

  def norm_linear(self, x, norm_weight, eps: float, w):
    """rms_norm(x) @ w with the norm's kernel writing the GEMM's groups (`fused_norm`)."""
    return _mlp.norm_linear(x, norm_weight, eps, w, self.precision, self.device)

  def norm(self, x, weight, eps: float, cd):
    """RMSNorm: x / rms(x) * weight over the last axis, the statistic in float32, out in cd."""
    if self.blocks.norm_linear == "invariant" and _inv_norm.chunk(x.shape[-1]):
      interpret = self.device.interpret_kernels  # one program a row, a fixed-order sum
      return _inv_norm.rms_norm(x, weight, eps, cd, interpret=interpret, reference=rms_norm_cd)
    if self.blocks.norm_linear in _INVARIANT:  # the exact sum of squares (exact_ops)
      return exact_ops.rms_norm(x, weight, eps, cd, reference=rms_norm_cd)
    return rms_norm_cd(x, weight, eps, cd)  # one formula with the fused kernels' backward

  def swiglu_down(self, gu, w_down, cd):
    """down(silu(gate) * up) from gate / up's one GEMM output gu [..., 2F] where a rollout's
    forward (weights quantized once) of more rows than a decode step's writes h's FP8 groups
    in SwiGLU's kernel (`swiglu_kernel.swiglu_gate_up_rows`) for a down GEMM that takes them
    (`gemms.takes_quantized_input`): compiled for a GPU, 1 x 128 block scaling, the fused MLP
    on, whole 128-row and 128-column tiles. Else None (the caller's unfused path). The groups
    are bit for bit those the unfused path quantizes (tests/models/test_prefill_swiglu.py)."""
    p = self.precision
    if self.blocks.mlp != "fused" or not isinstance(p, Precision):
      return None
    g = p.fprop
    if g is None or p.dgrad is not None or not isinstance(w_down, QuantizedWeight):
      return None  # a QuantizedInput is a forward-only precision's (`linear`)
    m, f2 = math.prod(gu.shape[:-1]), gu.shape[-1]
    f = f2 // 2
    if m <= _gemms.ONE_PASS_MAX_ROWS or m % _sk.B or f % _sk.B or w_down.shape[0] != f:
      return None
    if w_down.q.dtype != format_dtype(g.fmt):
      return None
    if not self.takes_quantized_input(g, m, w_down.shape[1], f, cd):
      return None
    hq = _sk.swiglu_gate_up_rows(
      gu.reshape(-1, f2), cd, format_dtype(g.fmt), interpret=self.interpret
    )  # h's 1 x 128 groups from gate and up, one kernel: no bf16 h, no quantization pass
    y = self.linear(QuantizedInput(*hq), w_down).astype(cd)
    return y.reshape(*gu.shape[:-1], y.shape[-1])

  def adapter_dot(self, x, m, cd):
    """x [..., K] @ m [K, J] in the compute dtype (a LoRA run's adapters' GEMMs): batch-
    invariant under an exact plan (exact dots: a row's result does not depend on the batch)."""
    if self.precision is None:
      return self.linear(x, m)
    plain = Precision(self.precision.compute_dtype)
    if self.blocks.linear in _INVARIANT:
      reference = lambda a, w: _precision_linear(a, w, plain, gemms=self).astype(jnp.float32)
      return exact_ops.matmul(x, m, cd, reference, kernel=self.exact_kernels).astype(cd)
    return _precision_linear(x, m, plain, gemms=self)

  def router(self, x, w, cd):
    """A mixture of experts' router: (logits [..., E] in cd, float32 softmax probabilities
    [..., E]) of x [..., D] and w [D, E]; not quantized, like the LM head. The batch-invariant
    plan's dot and softmax are exact (`adapter_dot`, `exact_ops.softmax`): a token's routing is
    the same in a decode step and in a training forward of any batch."""
    logits = self.adapter_dot(x, w, cd).astype(cd)
    z = logits.astype(jnp.float32)
    if self.blocks.linear == "exact":
      return logits, exact_ops.softmax(z)
    return logits, jax.nn.softmax(z, axis=-1)

  # Attention.

  def use_flash(self, t: int, head_dim: int, cd) -> bool:
    """Whether a forward over T tokens a row attends from its attention mask (`attend_flash`)
    instead of a [B, T, T] mask (`attend`): with the flash-attention kernel, or with the
    invariant attention (always; its backward is the flash kernels' where they apply)."""
    if self.blocks.attention == "invariant":
      return True
    return self.blocks.attention == "flash" and _attn.use_flash(
      self.precision, t, head_dim, cd, self.device
    )

  def attend_flash(self, q, k, v, attention_mask, cd):
    """Causal attention of a whole sequence, q [B, T, H, Dh], k, v [B, T, Hkv, Dh]."""
    if self.blocks.attention == "invariant":  # key blocks from each row's first real token
      t, dh = q.shape[1], q.shape[-1]
      bwd = None  # jet's flash backward, where its kernels take the shapes
      if _attn.use_flash(None, t, dh, cd, self.device) and _flash.partitioned_backward_available():
        bwd = functools.partial(
          _attn.attend_flash_backward, interpret=self.device.interpret_kernels
        )
      return _inv_attn.attend_causal(
        q, k, v, attention_mask, cd, interpret=self.device.interpret_kernels,
        flash_backward=bwd, reference=_attn.attend,
      )  # fmt: skip
    return _attn.attend_flash(q, k, v, attention_mask, cd, dev=self.device)

  @property
  def kv_fp8(self) -> bool:
    """Whether keys and values are held in FP8 (`Precision.kv_cache`): a KV cache stores them
    quantized (`KVCache.k_scale`, `v_scale`), a forward's attention reads them quantized and
    dequantized (`cached_kv`)."""
    return isinstance(self.precision, Precision) and self.precision.kv_cache == "fp8"

  def cached_kv(self, k, v):
    """The keys and values [..., Dh] a forward's attention reads: as a KV cache of the plan's
    precision hands them back (under an FP8 cache `kv_cache.round_kv`, the gradient straight
    through the rounding), so that the training forward reads the rollout's values."""
    return (round_kv(k), round_kv(v)) if self.kv_fp8 else (k, v)

  def attend(self, q, k, v, allowed, cd):
    """Masked GQA attention, q [B, T, H, Dh]; k, v [B, Hkv, S, Dh] (`kernels.attention`)."""
    if self.blocks.attention == "invariant":  # it reads no mask: attend_flash, cache_step
      raise ValueError("the invariant attention attends from an attention mask (attend_flash)")
    return _attn.attend(q, k, v, allowed, cd, self.blocks.attention == "exact", self.device)

  def cache_step(self, cache, mask, index, t: int, n: int, cd) -> CacheStep:
    """The attention of a step of T new tokens against a KV cache (`CacheStep`)."""
    return CacheStep(self, cache, mask, index, t, n, cd)

  # The LM head, and the sampling head: the log-prob a rollout records for its token.

  @property
  def grids_cache(self) -> bool:
    """Whether a KV cache keeps each value's grid exponent with it (`KVCache.v_exp`): the
    batch-invariant attention's, which then grids each key and value once, when written. Not
    with an FP8 KV cache: its attention grids the dequantized keys and values at every step."""
    return self.blocks.decode_attention == "exact" and not self.kv_fp8

  def choice_keep(self, logits, scaled, temperature, top_k, top_p):
    """The kept set [R, V] of a top-k / top-p truncated draw from float32 logits [R, V] (scaled:
    logits / temperature), or None when nothing is cut: under the batch-invariant plan by the
    exact rule its training forward uses (`truncation.keep_mask_exact`), bit for bit."""
    if not _truncation.is_truncated(top_k, top_p, logits.shape[-1]):
      return None
    if self.blocks.head in _INVARIANT:
      inv_t = exact_ops.inverse_temperature(temperature)
      return _truncation.keep_mask_exact(logits, inv_t, top_k, top_p)
    return _truncation.keep_mask(scaled, top_k, top_p)

  def choice_logprobs(self, logits, scaled, tokens, temperature, keep=None):
    """The log-probs [R] a rollout records for its tokens [R] drawn from float32 logits [R, V]
    (scaled: logits / temperature, or the logits themselves when greedy), over the kept set
    `keep` [R, V] of a truncated draw (the drawn tokens in it): under the batch-invariant plan
    by the training forward's own log-softmax (exact_ops), bit for bit; else by the training
    forward's formula (`head.stats_of_logits`)."""
    if self.blocks.head in _INVARIANT:
      return exact_ops.token_logprobs_from_logits(logits, tokens, temperature, keep)
    if keep is not None:
      z_tok = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
      lse = jax.nn.logsumexp(jnp.where(keep, scaled, -jnp.inf), axis=-1)
      return z_tok - lse
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

  @property
  def pads_to_tiles(self) -> bool:
    """Whether a training forward pads its tokens to whole tiles (a GPU's kernels, not the
    batch-invariant forward's exact sums)."""
    return self.gpu and self.blocks.head == "dot16"

  def head_grid(self, w, tied: bool, cd):
    """The head's weights on their exact-dot grids, once (a rollout's), where the plan's head
    reads them so (the batch-invariant head: `exact_ops.grid_lm_head`; on a GPU, w in cd,
    which its kernel reads); else None."""
    if self.blocks.head == "invariant":
      return w.astype(cd)
    return exact_ops.grid_lm_head(w, tied, cd) if self.blocks.head == "exact" else None

  def head(self, h, w, tied: bool, cd, grids=None):
    """float32 logits [..., V] of h [..., D] under the head w (`kernels.head`)."""
    if self.blocks.head == "invariant":
      w = w if grids is None else grids  # a rollout's head, in cd once
      return _inv_head.logits(h, w, tied, cd, interpret=self.device.interpret_kernels)
    return _head.logits(h, w, tied, cd, self.blocks.head, grids, kernel=self.exact_kernels)

  def head_stats(self, w, tied: bool, cd, temperature, top_k=None, top_p: float = 1.0):
    """f(h, targets) -> (logp, entropy) [B, C] of a chunk of hidden states [B, C, D]: on a
    GPU with its own backward (keeps only lse and the entropy: no checkpoint needed), else
    under `jax.checkpoint` (the backward recomputes the chunk's logits). Under top-k / top-p
    truncation, the truncated statistics (`jetrl.precision.truncation`), differentiated by JAX."""
    cut = _truncation.is_truncated(top_k, top_p, w.shape[0 if tied else -1])
    if self.blocks.head == "dot16" and not cut:
      return lambda hc, tc: _head.head_stats(hc, w, tc, temperature, tied, cd)
    impl, kernel = self.blocks.head, self.exact_kernels
    if impl == "invariant":
      stats = lambda hc, tc: _inv_head.chunk_stats(
        hc, tc, w, tied, cd, temperature, interpret=self.device.interpret_kernels, top_k=top_k,
        top_p=top_p,
      )  # fmt: skip
      return jax.checkpoint(stats) if cut else stats
    return jax.checkpoint(
      lambda hc, tc: _head.chunk_stats(
        hc, tc, w, tied, cd, temperature, impl, top_k, top_p, kernel=kernel
      )
    )


# The blocks' batch-invariant implementations: exact sums (any device), fixed-order kernels (GPU).
_INVARIANT = ("exact", "invariant")


def _linear_block(precision: Optional[Precision], dev: Device) -> str:
  if precision is None:
    return "plain"
  if precision.batch_invariant:
    return "exact"
  if precision.fprop is None:
    return "xla"
  try:
    return _backend.resolve(precision.fprop, dev)
  except ValueError:  # an explicit kernel that cannot run: said where a GEMM is traced
    return precision.fprop.gemm_backend


def resolve_plan(
  precision: Optional[Precision] = None, device: Union[Device, KernelConfig, None] = None
) -> Plan:
  """The plan for `precision` on `device`: a `Device`, a `KernelConfig` (for the device traced
  for now), or None (the device traced for now, the environment's settings; `current_device`).
  Blocks whose kernels take 16-bit values only (flash attention, the 16-bit head) check the
  compute dtype where they run."""
  if not (precision is None or isinstance(precision, Precision)):
    raise TypeError(f"resolve_plan: precision must be a Precision or None, got {type(precision)}")
  dev = device if isinstance(device, Device) else current_device(device)
  exact = isinstance(precision, Precision) and precision.batch_invariant
  fused = dev.gpu and dev.kernels.fused_mlp
  if exact and dev.gpu:  # fixed tiles and orders (kernels/invariant_*.py)
    blocks = Blocks(*["invariant"] * 6)
  elif exact:
    blocks = Blocks("exact", "exact", "exact", "exact", "exact", "exact")
  else:
    blocks = Blocks(
      linear=_linear_block(precision, dev),
      norm_linear="fused" if fused else "unfused",
      mlp="fused" if fused else "unfused",
      attention="flash" if dev.gpu else "xla",
      decode_attention="kernel" if dev.gpu else "xla",
      head="dot16" if dev.gpu else "xla",
    )
  return Plan(precision, dev, blocks)


def plan_for(precision, plan: Optional[Plan] = None) -> Plan:
  """`plan`, else the plan resolved for `precision` (which may itself be a Plan) now."""
  if plan is not None:
    return plan
  return precision if isinstance(precision, Plan) else resolve_plan(precision)
