"""A run's checkpoint as a Hugging Face folder that `transformers` loads and generates from.

  python experiments/export_hf.py --workdir=runs/gsm8k --out=exported/gsm8k
  python experiments/export_hf.py --workdir=runs/gsm8k --out=exported/gsm8k_step2 --step=2 \
      --dtype=bfloat16

The checkpoint's metadata holds the run's configuration: its model (--model.name, a preset or
a Hugging Face folder, --model.n_layers) and tokenizer (--model.tokenizer) give config.json and
the tokenizer files, chat template and generation config (its eos_token_id: every id the run's
samples stopped on); the checkpoint gives the weights, verified against their checksums. The
folder is written next to --out and renamed into place; nothing non-finite is written.
"""

from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.export import ExportConfig, export_run

if __name__ == "__main__":
  main(ExportConfig(), export_run, doc=__doc__, errors=(CheckpointError,))
