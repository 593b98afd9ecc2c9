"""Memory per model preset: parameters, AdamW state and KV cache, as a markdown table.

  python experiments/model_memory.py --batch=64 --seq_len=4096

Numbers are computed from the shapes alone (nothing is allocated). With --workdir, one JSON
line per preset is also written to <workdir>/model_memory.jsonl.
"""

from __future__ import annotations


from absl import app, flags

from _reports import check_presets, write_jsonl
from jetrl.models import PRESETS
from jetrl.models.cache import cache_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", list(PRESETS), "Presets to report.")
flags.DEFINE_integer("batch", 64, "Sequences in the KV cache.")
flags.DEFINE_integer("seq_len", 4096, "Slots per sequence in the KV cache.")
flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Stored params dtype.")
flags.DEFINE_enum("cache_dtype", "bfloat16", ["float32", "bfloat16"], "KV cache dtype.")
flags.DEFINE_string("workdir", None, "If set, also write model_memory.jsonl here.")

_BYTES = {"float32": 4, "bfloat16": 2}
GIB = 1024**3


def rows(names, batch, seq_len, param_dtype, cache_dtype):
  out = []
  for name in names:
    c = PRESETS[name]
    n = c.n_params
    kv = cache_bytes(c, batch, seq_len, _BYTES[cache_dtype])
    out.append(
      dict(
        preset=name,
        family=c.family,
        n_params=n,
        params_gib=n * _BYTES[param_dtype] / GIB,
        adamw_gib=2 * n * 4 / GIB,  # m and v in float32
        kv_kib_per_token=cache_bytes(c, 1, 1, _BYTES[cache_dtype]) / 1024,
        kv_cache_gib=kv / GIB,
        batch=batch,
        seq_len=seq_len,
        param_dtype=param_dtype,
        cache_dtype=cache_dtype,
      )
    )
  return out


def _size(gib: float) -> str:
  return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def markdown(table, batch, seq_len, param_dtype, cache_dtype) -> str:
  head = (
    f"| preset | family | params | params ({param_dtype}) | AdamW m+v (float32) | "
    f"KV / token ({cache_dtype}) | KV cache {batch}x{seq_len} ({cache_dtype}) |"
  )
  lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
  for r in table:
    lines.append(
      f"| {r['preset']} | {r['family']} | {r['n_params'] / 1e6:,.1f} M | "
      f"{_size(r['params_gib'])} | {_size(r['adamw_gib'])} | "
      f"{r['kv_kib_per_token']:.1f} KiB | {_size(r['kv_cache_gib'])} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  check_presets(FLAGS.presets)
  table = rows(FLAGS.presets, FLAGS.batch, FLAGS.seq_len, FLAGS.param_dtype, FLAGS.cache_dtype)
  print(markdown(table, FLAGS.batch, FLAGS.seq_len, FLAGS.param_dtype, FLAGS.cache_dtype))
  write_jsonl(FLAGS.workdir, "model_memory.jsonl", table)


if __name__ == "__main__":
  app.run(main)
