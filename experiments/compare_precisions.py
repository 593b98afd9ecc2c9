"""The precision-flow study: RL under several precision recipes, rollout lengths and seeds.

  python experiments/compare_precisions.py --report_dir=runs/study    # docs/precision_study.md
  python experiments/compare_precisions.py --report_dir=runs/s2 --lengths=2,4 --sft.length=2

The defaults are the design of docs/precision_study.md (bf16, fp8_rollout, fp8_rollout+tis and
jet; length 3; seeds 0-4). For every rollout length (the task's length knob; the generation
budget follows from the task's longest gold completion) one bf16 SFT warm start is trained
(skipped if present; with --sft.length, one shared by every length), then every (recipe, seed)
runs the same RL experiment from it, evaluated in its own rollout precision and in bf16; the
report adds paired intervals against bf16 and the verdicts. Finished combinations are skipped, so
rerunning the command resumes an interrupted study. Writes <report_dir>/report.md,
results.json and PNG plots. The RL flags are those of experiments/train.py (--optimizer.lr,
--sampling.temperature, --update.loss, ...), the warm start's are --sft.*. See
jetrl.study.
"""

import shlex
import sys

from jetrl.train.checkpoint import CheckpointError
from jetrl.train.cli import main
from jetrl.train.skips import SkippedUpdatesError
from jetrl.study import StudyConfig, run_study, set_by_study

# This script's flags from before the study had its warm start as a node; the others it had
# are the fields' own former names (`field(..., former=...)`).
RENAMED = {
  "sft_steps": "sft.steps",
  "sft_batch_size": "sft.batch_size",
  "sft_lr": "sft.optimizer.lr",
  "sft_seed": "sft.seed",
}


def study(cfg: StudyConfig) -> None:
  command = " ".join(
    shlex.quote(a) for a in ["python", "experiments/compare_precisions.py"] + sys.argv[1:]
  )
  run_study(cfg.replace(command=command))


if __name__ == "__main__":
  main(
    StudyConfig(),
    study,
    doc=__doc__,
    exclude=set_by_study(StudyConfig()),
    renamed=RENAMED,
    errors=(SkippedUpdatesError, CheckpointError),
  )
