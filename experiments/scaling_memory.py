"""Memory per device for each model preset and device mesh: params, AdamW state, KV cache.

  python experiments/scaling_memory.py --meshes='data:8;fsdp:8;fsdp:4,tensor:2' --batch=64

Computed from the shapes and jetrl.parallel's partition rules alone (nothing is allocated):
  params       float32 master weights in the training layout (fsdp x tensor split)
  AdamW        m and v, float32, mirroring the params' layout
  rollout copy the params in the sampling layout (fsdp folded into data), held while sampling
               when fsdp > 1 (0 otherwise: the training copy is used as is)
  KV cache     --batch sequences x --seq_len slots (bf16), batch over data x fsdp, kv heads
               over tensor when divisible
Activations, gradients (one float32 params-sized buffer during the update) and XLA scratch
are not included. "jet" says whether the mesh passes the FP8 block-alignment check. With
--workdir, one JSON line per (preset, mesh) goes to <workdir>/scaling_memory.jsonl.
"""

from __future__ import annotations

import math

import jax
from absl import app, flags

from _reports import check_presets, write_jsonl
from jetrl.models import PRESETS
from jetrl.models.params import param_shapes
from jetrl.parallel import check_fp8_alignment, param_specs, resolve_mesh_shape
from jetrl.precision import get_recipe

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", list(PRESETS), "Presets to report.")
flags.DEFINE_string(
  "meshes",
  "data:1;data:8;fsdp:8;fsdp:4,tensor:2;fsdp:2,tensor:4",
  "Meshes separated by ';' (each as for --mesh).",
)
flags.DEFINE_integer("devices", 8, "Device count the meshes are laid over.")
flags.DEFINE_integer("batch", 64, "Sequences in the KV cache (all devices together).")
flags.DEFINE_integer("seq_len", 4096, "Slots per sequence in the KV cache.")
flags.DEFINE_string("workdir", None, "If set, also write scaling_memory.jsonl here.")

GIB = 1024**3


def _split(spec, sizes) -> int:
  n = 1
  for axes in spec:
    if axes is None:
      continue
    for a in (axes,) if isinstance(axes, str) else axes:
      n *= sizes[a]
  return n


def per_device(name: str, mesh: str, devices: int, batch: int, seq_len: int) -> dict:
  cfg = PRESETS[name]
  row = dict(preset=name, mesh=mesh)
  try:
    sizes = (
      resolve_mesh_shape(mesh, devices) if mesh != "data:1" else dict(data=1, fsdp=1, tensor=1)
    )
    train = param_specs(cfg, sizes, "train")
    sample = param_specs(cfg, sizes, "sample")
  except ValueError as e:
    return dict(row, error=str(e).split(";")[0])
  try:
    check_fp8_alignment(cfg, train, sizes, get_recipe("jet"))
    check_fp8_alignment(cfg, sample, sizes, get_recipe("jet"))
    row["jet"] = True
  except ValueError:
    row["jet"] = False
  shapes = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
  leaves = lambda t: jax.tree_util.tree_leaves(
    t, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )
  params = sum(math.prod(s) * 4 / _split(p, sizes) for s, p in zip(shapes, leaves(train)))
  rollout = (
    sum(math.prod(s) * 4 / _split(p, sizes) for s, p in zip(shapes, leaves(sample)))
    if sizes["fsdp"] > 1
    else 0.0
  )
  rows = sizes["data"] * sizes["fsdp"]
  heads = sizes["tensor"] if cfg.n_kv_heads % sizes["tensor"] == 0 else 1
  kv = 2 * cfg.n_layers * (batch / rows) * seq_len * cfg.kv_dim * 2 / heads
  row.update(
    params_gib=params / GIB, adamw_gib=2 * params / GIB, rollout_gib=rollout / GIB, kv_gib=kv / GIB
  )
  row["total_gib"] = row["params_gib"] + row["adamw_gib"] + row["rollout_gib"] + row["kv_gib"]
  return row


def _size(gib: float) -> str:
  return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def markdown(table, batch, seq_len) -> str:
  lines = [
    f"| preset | mesh | params f32 | AdamW m+v | rollout copy | KV {batch}x{seq_len} "
    f"bf16 | total / device | jet aligned |",
    "|---|---|---:|---:|---:|---:|---:|:-:|",
  ]
  for r in table:
    if "error" in r:
      lines.append(f"| {r['preset']} | {r['mesh']} | — | — | — | — | — | invalid: {r['error']} |")
      continue
    lines.append(
      f"| {r['preset']} | {r['mesh']} | {_size(r['params_gib'])} | "
      f"{_size(r['adamw_gib'])} | {_size(r['rollout_gib'])} | {_size(r['kv_gib'])} | "
      f"{_size(r['total_gib'])} | {'yes' if r['jet'] else 'no'} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  check_presets(FLAGS.presets)
  meshes = [m.strip() for m in FLAGS.meshes.split(";")]
  table = [
    per_device(p, m, FLAGS.devices, FLAGS.batch, FLAGS.seq_len)
    for p in FLAGS.presets
    for m in meshes
  ]
  print(markdown(table, FLAGS.batch, FLAGS.seq_len))
  write_jsonl(FLAGS.workdir, "scaling_memory.jsonl", table)


if __name__ == "__main__":
  app.run(main)
