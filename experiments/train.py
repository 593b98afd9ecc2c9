"""RL training run: `python experiments/train.py --workdir=runs/jet --recipe=jet ...`.

Every flag is a field of jetrl.train.TrainConfig (see `--helpfull`). Metrics go to
<workdir>/metrics.jsonl (+ eval.jsonl, TensorBoard under tb/, PNG plots under plots/).
Rerunning the same command resumes from the latest checkpoint in the workdir.
"""

import sys

from absl import app, flags

from jetrl.train import TrainConfig, run
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.flags import config_from_flags, define_flags
from jetrl.train.skips import SkippedUpdatesError
from jetrl.train.validation import FlagError

define_flags(TrainConfig)
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_from_flags(TrainConfig).validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:
    summary = run(cfg)
  except FlagError as e:  # found at start-up (devices, memory, workdir, checkpoint flags)
    raise app.UsageError(str(e)) from None
  except (SkippedUpdatesError, CheckpointError) as e:
    sys.exit(f"error: {e}")
  print(f"done: held-out greedy accuracy {summary['eval_before']} -> {summary['eval_after']}; "
        f"plots: {', '.join(summary.get('plots', []))}")


if __name__ == "__main__":
  app.run(main)
