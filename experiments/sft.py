"""Supervised warm start on a task's gold solutions.

  python experiments/sft.py --workdir=runs/sft --task=addition --steps=300
  python experiments/train.py --workdir=runs/rl --init_from=runs/sft ...

Checkpoints every --ckpt_every steps; rerunning the same command resumes from the latest
intact one (see docs/reliability.md).
"""

import sys

from absl import app, flags

from jetrl.train import SFTConfig, run_sft
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.flags import config_from_flags, define_flags
from jetrl.train.skips import SkippedUpdatesError
from jetrl.train.validation import FlagError

define_flags(SFTConfig)
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_from_flags(SFTConfig).validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:
    run_sft(cfg)
  except FlagError as e:  # found at start-up (memory, workdir, checkpoint flags)
    raise app.UsageError(str(e)) from None
  except (SkippedUpdatesError, CheckpointError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
