"""Checksums of the arrays of a checkpoint, so a restore can tell intact bytes from damaged ones.

A flipped bit in a saved tensor can leave a checkpoint that loads without error and trains on
silently (a restored step held 574 changed params and 3 NaNs). Each array gets a 64-bit digest,
stored in the checkpoint's metadata and compared after a restore.

The digest is computed by jitted code on the arrays where they live, so it works the same for
arrays sharded over devices and hosts (no gather to one host): every element's bits are mixed
with its flat index by two 32-bit finalisers (MurmurHash3's fmix32 with different seeds) and
the mixed words are summed modulo 2**32. Any change of one element changes each half of the
digest with probability 1 - 2**-32; moving values to other positions changes it too. It guards
against damage, not against an adversary who can write the checkpoint.

A checkpoint's metadata (step, data position, config, the arrays' digests) carries a SHA-256 of
the rest of it (`meta_digest`, under `META_CHECKSUM`). Both are required: a checkpoint whose
metadata lacks either is damaged (`verify_meta`, `verify`), never trusted as it is (deleting
the metadata's checksum once switched the check off, and an edited step resumed).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp

META_CHECKSUM = "meta_checksum"  # SHA-256 of the rest of the metadata
_SEEDS = (0x9E3779B9, 0x85EBCA6B)
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x) -> jax.Array:
  """The array's bits as a flat uint32 vector (one word per element)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.reshape(-1).astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size not in _UNSIGNED:
    raise ValueError(f"checksum: unsupported dtype {x.dtype} (itemsize {size})")
  return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).reshape(-1).astype(jnp.uint32)


def _digest(x) -> jax.Array:
  words = _words(x)
  index = jnp.arange(words.shape[0], dtype=jnp.uint32)
  halves = [
    jnp.sum(_fmix32(words ^ _fmix32(index ^ jnp.uint32(seed))), dtype=jnp.uint32) for seed in _SEEDS
  ]
  return jnp.stack(halves)


@functools.partial(jax.jit)
def _digests(leaves):
  return [_digest(x) for x in leaves]


def tree_checksums(tree: Any, prefix: str = "") -> dict[str, str]:
  """{prefix + leaf path (jax keystr): 16 hex digits} for every array leaf of `tree`."""
  flat = [
    (prefix + jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if hasattr(leaf, "shape")
  ]
  digests = jax.device_get(_digests([leaf for _, leaf in flat]))
  return {path: f"{int(d[0]):08x}{int(d[1]):08x}" for (path, _), d in zip(flat, digests)}


def mismatches(saved: dict[str, str], tree: Any, prefix: str = "") -> list[str]:
  """Leaf paths whose checksum differs from `saved` (or that are missing on either side).

  With `prefix`, `tree` is the subtree at that path (e.g. "['params']") and only the saved
  entries under it are compared."""
  now = tree_checksums(tree, prefix)
  wanted = {k: v for k, v in saved.items() if k.startswith(prefix)}
  return sorted(k for k in set(wanted) | set(now) if wanted.get(k) != now.get(k))


def non_finite(tree: Any) -> list[str]:
  """Leaf paths of floating-point arrays holding a NaN or an Inf."""
  flat = [
    (jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
  ]
  ok = jax.device_get(_all_finite([leaf for _, leaf in flat]))
  return [path for (path, _), good in zip(flat, ok) if not good]


@jax.jit
def _all_finite(leaves):
  return [jnp.all(jnp.isfinite(x)) for x in leaves]


def meta_digest(meta: dict) -> str:
  """SHA-256 of the metadata's canonical JSON (sorted keys), its own checksum left out."""
  body = {k: v for k, v in meta.items() if k != META_CHECKSUM}
  text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(text.encode()).hexdigest()


def verify_meta(meta: dict, where: str, step: Any = None) -> None:
  """ValueError unless the metadata holds its checksum and the arrays' checksums, matches its
  checksum, and (given `step`: the checkpoint's folder) records that step."""
  missing = [k for k in (META_CHECKSUM, "checksums") if k not in meta]
  if missing:
    raise ValueError(
      f"{where}: the metadata has no {' and no '.join(missing)} (every checkpoint is written "
      "with both; removed, its step, data position and config cannot be trusted)"
    )
  if meta[META_CHECKSUM] != meta_digest(meta):
    raise ValueError(
      f"{where}: the metadata (step, data position, config, array checksums) does not match "
      "its checksum"
    )
  if step is not None and meta.get("step") != step:
    raise ValueError(
      f"{where}: the metadata says step {meta.get('step')!r}, its folder is step {step}"
    )


def verify(state: Any, meta: dict, where: str, prefix: str = "") -> None:
  """ValueError unless `state` (the subtree at `prefix`, when given) matches the checksums in
  `meta` (every saved one under `prefix`, none missing) and is finite."""
  saved = meta.get("checksums")
  if not isinstance(saved, dict):
    raise ValueError(f"{where}: the metadata has no checksums of the arrays")
  wrong = mismatches(saved, state, prefix)
  if wrong:
    raise ValueError(
      f"{where}: {len(wrong)} arrays do not match their checksums: "
      f"{wrong[:4]}{' ...' if len(wrong) > 4 else ''}"
    )
  bad = non_finite(state)
  if bad:
    raise ValueError(f"{where}: non-finite values (NaN or Inf) in {bad[:4]}")
