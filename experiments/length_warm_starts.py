"""Exploratory, after the fourth round's length gate failed (docs/study/round4/amendments.md):
does the length part's registered warm start (400 SFT steps at lengths 20, 3 and 9, answer
noise 0.5; `jetrl.study.round4_design.LENGTH`) answer at length 20 under other SFT seeds, and
what does it answer at the shorter lengths it also saw?

  python experiments/length_warm_starts.py --root=runs/length_warm_starts --seeds=0,1,2,3,4,5 \
      --out=docs/study/round4/length_warm_starts.json

For each SFT seed: trains that warm start under --root (skipped when its sft_summary.json is
there; a stopped one resumes from its checkpoint), then evaluates its final params at each of
--lengths as the gate did (bf16 sampling at temperature 0.5, 4 samples of each of 256 held-out
problems drawn with the SFT seed; the gate read length 20 from the SFT's own summary). Prints a
table and, with --out, writes the accuracies as JSON. Not part of any pre-registered analysis:
it informs the choice of a later round's setting.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "src"))

from jetrl.study import round4  # noqa: E402
from jetrl.study.config import sft_config  # noqa: E402
from jetrl.train.run_files import write_atomic  # noqa: E402
from jetrl.train.sft import run_sft  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("root", "runs/length_warm_starts", "Folder of the warm starts.")
flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4", "5"], "SFT seeds to train and evaluate.")
flags.DEFINE_list("lengths", ["3", "9", "20"], "Task lengths to evaluate each warm start at.")
flags.DEFINE_string("out", None, "Also write the accuracies as JSON here.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    seeds, lengths = [int(s) for s in FLAGS.seeds], [int(n) for n in FLAGS.lengths]
  except ValueError:
    raise app.UsageError(f"--seeds and --lengths take integers: {FLAGS.seeds}, {FLAGS.lengths}")
  rows = []
  for seed in seeds:
    cfg = round4.study_config("length", seed, FLAGS.root)
    sft = sft_config(cfg, cfg.lengths[0])
    if not os.path.exists(os.path.join(sft.workdir, "sft_summary.json")):
      print(f"SFT seed {seed}: {sft.steps} SFT steps at lengths {sft.mix_lengths} -> {sft.workdir}")
      run_sft(sft, log=lambda *a, **k: None)
    acc = {str(n): float(round4.warm_start_eval(sft, n)["eval_accuracy"]) for n in lengths}
    print(f"SFT seed {seed}: " + ", ".join(f"length {n} {a:.3f}" for n, a in acc.items()))
    rows.append(dict(sft_seed=seed, accuracy=acc))
  print("| SFT seed | " + " | ".join(f"length {n}" for n in lengths) + " |")
  print("|---|" + "---|" * len(lengths))
  for r in rows:
    print(f"| {r['sft_seed']} | " + " | ".join(f"{a:.3f}" for a in r["accuracy"].values()) + " |")
  if FLAGS.out:
    write_atomic(
      FLAGS.out, json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=1) + "\n"
    )
    print(f"wrote {FLAGS.out}")
  return 0


if __name__ == "__main__":
  app.run(main)
