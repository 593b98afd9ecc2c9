"""Supervised warm start on a task's gold solutions.

  python experiments/sft.py --workdir=runs/sft --task.name=addition --task.length=3 --steps=150
  python experiments/train.py --workdir=runs/rl --init_from=runs/sft ...
  python -m jetrl.launch --processes=2 -- experiments/sft.py --workdir=runs/sft --mesh=data:2

Every flag is a field of jetrl.train.SFTConfig, named by its path in the configuration
(--optimizer.lr, --task.name, ...); --config=FILE reads a whole configuration. Checkpoints
every --checkpoint.every steps; rerunning the same command resumes from the latest intact one
(see docs/reliability.md).
"""

from jetrl.data import RewardError
from jetrl.train import SFTConfig, run_sft
from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.skips import SkippedUpdatesError

if __name__ == "__main__":
  main(
    SFTConfig(),
    run_sft,
    doc=__doc__,
    errors=(SkippedUpdatesError, CheckpointError, RewardError),
  )
