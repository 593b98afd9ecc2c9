"""The precision-flow study: RL under several precision recipes and rollout lengths.

  python experiments/compare_precisions.py --report_dir=runs/study \\
      --recipes=bf16,fp8_rollout,fp8_rollout+tis,jet,fp8_tensor --lengths=3,8 --seeds=0

For every rollout length (the task's `length` knob; max_new_tokens follows from the task's
longest gold completion) one bf16 SFT warm start is trained (skipped if present), then every
(recipe, seed) runs the same RL experiment from it. Finished combinations are skipped, so
rerunning the command resumes an interrupted study. Writes <report_dir>/report.md, results.json
and PNG plots. See jetrl.train.study.
"""

import dataclasses
import shlex
import sys

from absl import app, flags

from jetrl.train.study import StudyConfig, run_study

_LISTS = {"recipes": str, "lengths": int, "seeds": int}


def _define():
  for f in dataclasses.fields(StudyConfig):
    if f.name == "command":
      continue
    help_text = f.metadata.get("help", f.name)
    if f.name in _LISTS:
      flags.DEFINE_list(f.name, [str(x) for x in f.default], help_text)
    elif isinstance(f.default, float):
      flags.DEFINE_float(f.name, f.default, help_text)
    elif isinstance(f.default, int):
      flags.DEFINE_integer(f.name, f.default, help_text)
    else:
      flags.DEFINE_string(f.name, f.default, help_text)
  flags.DEFINE_bool("quiet_runs", False, "Hide the per-step lines of the individual runs.")


_define()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  values = {}
  for f in dataclasses.fields(StudyConfig):
    if f.name == "command":
      continue
    v = FLAGS[f.name].value
    values[f.name] = tuple(_LISTS[f.name](x) for x in v) if f.name in _LISTS else v
  command = " ".join(shlex.quote(a) for a in ["python", "experiments/compare_precisions.py"]
                     + sys.argv[1:])
  try:
    cfg = StudyConfig(**values, command=command).validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  run_study(cfg, quiet_runs=FLAGS.quiet_runs)


if __name__ == "__main__":
  app.run(main)
