"""The attention of a step of T new tokens against a KV cache, in the kernels a `Plan` picks:
what `jetrl.models.forward_cached` calls for each layer (`CacheStep`).

  a GPU's decode step (T = 1)  one Pallas kernel over the whole cache, reading its first n
      slots (decode_attention.py); with a rollout's fused q / k / v weight, the bias, RoPE and
      the cache write in the same kernel (`attend_qkv`); under an FP8 rollout whose every
      projection takes a quantized input, the whole layer stack in the fused kernels
      (decode_fused.py, `layers`)
  the invariant attention (a GPU's batch-invariant forward)  one Pallas kernel over the whole
      cache, read in place, which slots a query sees computed in it (invariant_attention.py)
  the batch-invariant forward  with a gridded cache (`KVCache.v_exp`), each new key and value
      written on its grid once (`attention.write_grids`, `attend_grids`); without one, the
      whole cache gridded at every step (the same logits, slower)
  otherwise                    the new keys and values written into the cache, then
      `attention.attend` over its first n slots

Under an FP8 KV cache (`Plan.kv_fp8`) the new keys and values are quantized as they are
written (`kv_cache.quantize_kv`) and attention reads the cache's FP8 values with their scales:
a GPU's decode step in the one kernel (head size up to 128: one group a head; not the fused
q / k / v or whole-step kernels, which write a cache in the compute dtype), elsewhere
`attention.attend` over the dequantized slots (`kv_cache.dequantize_kv`; the batch-invariant
forward grids them at every step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetrl.kernels import attention as _attn
from jetrl.kernels import decode_attention as _da
from jetrl.kernels import decode_fused as _fused
from jetrl.kernels import invariant_attention as _inv
from jetrl.precision.kv_cache import dequantize_kv, quantize_kv


class CacheStep:
  """One step's attention against the cache's layers (built by `Plan.cache_step`, inside the
  traced step: it holds the step's traced operands, and collects each layer's new cache)."""

  def __init__(self, plan, cache, mask, index, t: int, n: int, cd):
    self.plan, self.cache, self.n, self.cd = plan, cache, n, cd
    s = mask.shape[-1]
    zero = jnp.zeros((), jnp.int32)
    q_slots = index + jnp.arange(t, dtype=jnp.int32)
    k_slots = jnp.arange(n, dtype=jnp.int32)
    self.allowed = (k_slots[None, :] <= q_slots[:, None])[None] & mask[:, None, :n]  # [B, T, n]
    self.view = lambda a: a if n == s else a[:, :, :n]  # the slots attention reads
    self.start = (zero, zero, index, zero)
    head_dim = cache.k[0].shape[-1]
    self.fp8 = plan.kv_fp8  # an FP8 cache: E4M3 keys and values with their scales
    self.one_kernel = (
      t == 1
      and plan.blocks.decode_attention == "kernel"
      and _attn.use_decode_kernel(n, head_dim, plan.device)
      and not (self.fp8 and not _da.supports_fp8(head_dim))
    )
    if self.one_kernel:  # the slots the kernel may see, once for all layers, in its forms
      self.seen = mask & (jnp.arange(s, dtype=jnp.int32)[None, :] <= index)
      self.seen32, self.index1 = self.seen.astype(jnp.int32), index.reshape(1)
    self.invariant = plan.blocks.decode_attention == "invariant"
    if self.invariant:  # which slots each row's queries see, once for all layers
      self.slots = _inv.slots(mask, index, t)
    # A batch-invariant plan with a gridded cache writes each new key / value on its grid.
    self.grids = plan.blocks.decode_attention == "exact" and len(cache.v_exp) == len(cache.k)
    self.new_k, self.new_v, self.new_e, self.new_ks, self.new_vs = [], [], [], [], []

  def layers(self, x, layers, config, cos, sin):
    """(x, ()) after all `layers` in the fused decode kernels where they apply (an FP8
    rollout's decode step on a GPU: every projection's input quantized by the operator
    before it, eight kernels a layer), else (x, layers): the caller runs them one by one."""
    plan = self.plan
    if self.fp8 or not (
      self.one_kernel and _fused.applies(layers, config, plan, x.shape[0], self.n)
    ):
      return x, layers
    x, self.new_k, self.new_v = _fused.layers_step(
      x, layers, config, plan, self.cd, cos, sin, self.cache, self.seen32, self.index1, self.n
    )
    return x, ()

  def fuses_qkv(self, layer, config) -> bool:
    """Whether layer i's bias, RoPE, cache write and attention run in one kernel from its
    fused q / k / v GEMM's output (`attend_qkv`)."""
    return self.one_kernel and not self.fp8 and _da.fuses_layer(layer, config)

  def attend_qkv(self, i: int, y, layer, config, cos, sin):
    """Attention output [B, 1, H * Dh] of layer i from its q / k / v GEMM's output y."""
    out, kc, vc = _da.decode_step_attention(
      y, _da.qkv_bias(layer), cos, sin, self.cache.k[i], self.cache.v[i], self.seen32,
      self.index1, self.n, self.cd, n_heads=config.n_heads, interpret=self.plan.interpret,
    )  # fmt: skip
    self.new_k.append(kc)
    self.new_v.append(vc)
    return out

  def attend(self, i: int, q, k, v):
    """Attention output [B, T, H * Dh] of layer i: q [B, T, H, Dh], the new k, v [B, T, Hkv,
    Dh] written into its cache first."""
    cache, cd, view, plan = self.cache, self.cd, self.view, self.plan
    k, v = _attn.heads_first(k), _attn.heads_first(v)
    if self.fp8:
      return self._attend_fp8(i, q, k, v)
    if self.grids:
      kc, vc, ec = _attn.write_grids(cache.k[i], cache.v[i], cache.v_exp[i], k, v, self.start, cd)
      out = _attn.attend_grids(q, view(kc), view(vc), view(ec), self.allowed, cd, plan.device)
      self.new_e.append(ec)
    else:
      kc = jax.lax.dynamic_update_slice(cache.k[i], k.astype(cache.k[i].dtype), self.start)
      vc = jax.lax.dynamic_update_slice(cache.v[i], v.astype(cache.v[i].dtype), self.start)
      if self.one_kernel:
        out = _da.decode_attention(q, kc, vc, self.seen, self.n, cd, interpret=plan.interpret)
      elif self.invariant:  # the whole cache, read in place (no slice of its first n slots)
        interpret = plan.device.interpret_kernels
        out = _inv.attend_cache(q, kc, vc, self.slots, cd, interpret=interpret)
      else:
        out = plan.attend(q, view(kc), view(vc), self.allowed, cd)
    self.new_k.append(kc)
    self.new_v.append(vc)
    return out

  def _attend_fp8(self, i: int, q, k, v):
    """`attend` into an FP8 cache: k, v [B, Hkv, T, Dh] quantized and written with their
    scales, then attention over the FP8 slots read with their scales."""
    cache, cd, view, plan = self.cache, self.cd, self.view, self.plan
    update = lambda a, new: jax.lax.dynamic_update_slice(a, new, self.start)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    kc, vc = update(cache.k[i], kq), update(cache.v[i], vq)
    ksc, vsc = update(cache.k_scale[i], ks), update(cache.v_scale[i], vs)
    if self.one_kernel:
      out = _da.decode_attention(
        q, kc, vc, self.seen, self.n, cd, scales=(ksc, vsc), interpret=plan.interpret
      )
    elif self.invariant:  # the whole cache dequantized, then read as a plain one
      kd, vd = dequantize_kv(kc, ksc, cd), dequantize_kv(vc, vsc, cd)
      interpret = plan.device.interpret_kernels
      out = _inv.attend_cache(q, kd, vd, self.slots, cd, interpret=interpret)
    else:
      kd, vd = dequantize_kv(view(kc), view(ksc), cd), dequantize_kv(view(vc), view(vsc), cd)
      out = plan.attend(q, kd, vd, self.allowed, cd)
    self.new_k.append(kc)
    self.new_v.append(vc)
    self.new_ks.append(ksc)
    self.new_vs.append(vsc)
    return out

  def new_cache(self):
    """The layers' (keys, values, value exponents, key scales, value scales) after the step,
    as tuples."""
    v_exp = tuple(self.new_e) if self.grids else self.cache.v_exp
    scales = (
      (tuple(self.new_ks), tuple(self.new_vs))
      if self.fp8
      else (self.cache.k_scale, self.cache.v_scale)
    )
    return tuple(self.new_k), tuple(self.new_v), v_exp, *scales
