"""The pre-registered learning test's verdicts (docs/study/prereg_round3.md), from its runs.

  python experiments/prereg_judge.py --runs=docs/study/prereg3/runs \
      --exploratory=docs/study/dose9/runs --json_out=docs/study/prereg3/verdicts.json

Reads every finished run (a `summary.json` beside its metrics.jsonl and eval.jsonl) under
--runs/L<length>/<arm>/seed<s>, takes each run's outcomes (`jetrl.study.prereg`: primary, the
mean training reward over the last 10 steps; secondary, the bf16-scored held-out accuracy over
the last three evaluations) and applies the committed rules to the primary outcome per arm
against bf16, paired by seed: drop / no drop / inconclusive with Holm's correction over the
arms, and the crossover's attribution. The secondary outcome is reported with the same
intervals, not judged. Arms under --exploratory (not part of the test, e.g. the mismatch
dose-response) are reported against the same bf16 runs, not judged; bf16 runs under
--exploratory pair with them at seeds the test's bf16 has not run (they are not part of the
test; at seeds the test's bf16 has run, the test's run is the one used, once). A test cut
short is judged on its whole seeds, the seeds that every arm finished (`prereg.whole_seeds`;
every arm's seeds are listed). The crossover's contrasts within itself
(`prereg.crossover_contrasts`: jet's training step against the exact one, jet's rollout against
the bitwise one, their interaction) are reported as post hoc, not judged.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from jetrl.study import StudyConfig  # noqa: E402
from jetrl.study import prereg  # noqa: E402
from jetrl.study.stats import BASELINE, paired_interval  # noqa: E402
from jetrl.study.summary import summarize_run  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "runs", "docs/study/prereg3/runs", "The test's runs: <dir>/L<len>/<arm>/seed<s>."
)
flags.DEFINE_list("exploratory", [], "Directories of runs of other arms, reported, not judged.")
flags.DEFINE_integer("length", 9, "The task length the test ran at.")
flags.DEFINE_string("json_out", None, "Write the verdicts and every run's outcomes here.")
flags.DEFINE_list(
  "dose", [], "Rollout-only arms of the dose-response (bf16 training), in the order to plot."
)
flags.DEFINE_string("gradients", None, "experiments/gradient_study.py's JSON (cosines to plot).")
flags.DEFINE_string("dose_plot", None, "Write the dose-response figure (PNG) here.")
flags.DEFINE_list(
  "seen_seeds",
  [],
  "Seeds whose outcomes were seen when the crossover's contrasts were chosen: the contrasts are "
  "reported again on the whole seeds not among them.",
)

_SEED = re.compile(r"^seed(\d+)$")


def rows_of(root: str, length: int) -> list[dict]:
  """One row per finished run under root/L<length>: recipe, seed and `summarize_run`'s fields."""
  base = os.path.join(root, f"L{length}")
  if not os.path.isdir(base):
    raise app.UsageError(f"--runs: no folder {base} (runs are kept as <dir>/L<len>/<arm>/seed<s>)")
  cfg = StudyConfig()
  rows = []
  for arm in sorted(os.listdir(base)):
    for s in sorted(os.listdir(os.path.join(base, arm))):
      m = _SEED.match(s)
      d = os.path.join(base, arm, s)
      if m and os.path.exists(os.path.join(d, "summary.json")):
        rows.append(dict(length=length, recipe=arm, seed=int(m.group(1)), **summarize_run(cfg, d)))
  return rows


def _interval_text(v: dict) -> str:
  pts = lambda x: f"{100 * x:+.1f}"
  return f"{pts(v['mean'])} [{pts(v['lo'])}, {pts(v['hi'])}]"


def report(
  rows: list[dict], extra: list[dict], length: int, seen: tuple[int, ...] = ()
) -> tuple[str, dict]:
  out = {"seeds": {}, "primary": {}, "secondary": {}, "exploratory": {}}
  for r in rows + [r for r in extra if r["recipe"] != BASELINE]:
    out["seeds"].setdefault(r["recipe"], []).append(r["seed"])
  # A bf16 run kept beside the exploratory arms at a seed the test has run too (e.g. copied
  # into the test's folder) is the test's: it is neither listed apart nor counted twice.
  test_base = {r["seed"] for r in rows if r["recipe"] == BASELINE}
  extra = [r for r in extra if r["recipe"] != BASELINE or r["seed"] not in test_base]
  out["baseline_seeds_beside"] = sorted(r["seed"] for r in extra if r["recipe"] == BASELINE)
  verdict = prereg.judge(rows, length, outcome=prereg.primary)
  out["primary"] = verdict
  sec = prereg.judge(rows, length, outcome=prereg.secondary)
  out["secondary"] = sec["arms"]
  out["whole_seeds"] = verdict["seeds"]
  outcomes = (("primary", prereg.primary), ("secondary", prereg.secondary))
  out["crossover_post_hoc"] = {
    name: prereg.crossover_contrasts(rows, length, outcome=fn) for name, fn in outcomes
  }
  unseen = [s for s in verdict["seeds"] if s not in seen]
  if seen:
    out["crossover_unseen_seeds"] = {
      name: prereg.crossover_contrasts(rows, length, outcome=fn, seeds=unseen)
      for name, fn in outcomes
    }
  base = {r["seed"]: r for r in extra if r["recipe"] == BASELINE}
  base.update({r["seed"]: r for r in rows if r["recipe"] == BASELINE})  # the test's own first
  for arm in sorted({r["recipe"] for r in extra} - {BASELINE}):
    mine = {r["seed"]: r for r in extra if r["recipe"] == arm}
    seeds = sorted(set(mine) & set(base))
    out["exploratory"][arm] = {
      name: paired_interval([fn(mine[s]) - fn(base[s]) for s in seeds])
      for name, fn in (("primary", prereg.primary), ("secondary", prereg.secondary))
    }
  lines = [
    f"Seeds finished: {', '.join(f'{a} {len(s)}' for a, s in sorted(out['seeds'].items()))}",
    f"Judged on the whole seeds (every arm of the test finished): {verdict['seeds']}",
    f"bf16 runs kept beside the exploratory arms: seeds {out['baseline_seeds_beside']}",
    "",
    "| arm | n | primary: - bf16, points [95% CI] | p | p (Holm) | call | secondary: - bf16 [95% CI] |",
    "|---|---:|---|---:|---:|---|---|",
  ]
  for arm, v in verdict["arms"].items():
    s = sec["arms"].get(arm)
    lines.append(
      f"| {arm} | {v['n']} | {_interval_text(v)} | {v['p']:.3f} | {v['p_holm']:.3f} | "
      f"**{v['call']}** | {_interval_text(s) if s else '-'} |"
    )
  lines += ["", f"Attribution: **{verdict['attribution']}**"]
  names = {
    "training": "jet's training step - the exact one",
    "rollout": "jet's rollout - the bitwise one",
    "interaction": "interaction",
  }
  for key, title in (
    ("crossover_post_hoc", "Within the crossover (post hoc, not a committed rule; paired by seed)"),
    ("crossover_unseen_seeds", f"The same on the seeds not seen when it was chosen ({unseen})"),
  ):
    xo = out.get(key)
    if not xo or not xo["primary"]:
      continue
    lines += [
      "",
      f"{title}:",
      "",
      "| contrast | primary, points [95% CI] | p | secondary, points [95% CI] | p | primary per seed |",
      "|---|---|---:|---|---:|---|",
    ]
    for k, label in names.items():
      p, s = xo["primary"][k], xo["secondary"][k]
      per = ", ".join(f"{100 * x:+.1f}" for x in p["per_seed"])
      lines.append(
        f"| {label} | {_interval_text(p)} | {p['p']:.3f} | {_interval_text(s)} | {s['p']:.3f} "
        f"| {per} |"
      )
  if out["exploratory"]:
    lines += [
      "",
      "Exploratory (not judged):",
      "",
      "| arm | n | primary: - bf16 [95% CI] | p | secondary: - bf16 [95% CI] | p |",
      "|---|---:|---|---:|---|---:|",
    ]
    for arm, v in out["exploratory"].items():
      p, s = v["primary"], v["secondary"]
      lines.append(
        f"| {arm} | {p['n']} | {_interval_text(p)} | {p['p']:.3f} | {_interval_text(s)} | "
        f"{s['p']:.3f} |"
      )
  out["runs"] = [
    dict(
      recipe=r["recipe"],
      seed=r["seed"],
      primary=prereg.primary(r),
      secondary=prereg.secondary(r),
      eval_accuracy_bf16=r["eval_accuracy_bf16"],
      collapsed="collapsed" in r["diverged_why"],
      abs_diff_mean=r["abs_diff_mean"],
    )
    for r in rows + extra
  ]
  return "\n".join(lines), out


def dose_points(rows, out, arms, length: int, gradients) -> list[dict]:
  """Per rollout-only arm: its mismatch in the learning runs (mean over runs of each run's
  mean over steps), its paired primary difference from bf16, and the gradient study's cosine
  at the same length."""
  grads = {}
  if gradients:
    for res in json.load(open(gradients, encoding="utf-8"))["results"]:
      if res["length"] == length:
        grads = {k: v["vs_own_cosine"]["mean"] for k, v in res["recipes"].items()}
  points = []
  for arm in arms:
    mine = [r for r in rows if r["recipe"] == arm]
    if not mine:
      raise app.UsageError(f"--dose: no finished run of {arm!r}")
    v = out["primary"]["arms"].get(arm) or out["exploratory"].get(arm, {}).get("primary")
    mean = lambda k: float(sum(r[k] for r in mine) / len(mine))
    points.append(
      dict(
        label=arm,
        runs=len(mine),
        kl=mean("kl_k3"),
        abs_diff=mean("abs_diff_mean"),
        diff=v["mean"],
        lo=v["lo"],
        hi=v["hi"],
        grad_cosine=grads.get(arm),
      )
    )
  return points


def dose_table(points) -> str:
  lines = [
    "| rollout (bf16 training) | runs | k3 KL per token | mean \\|Δ\\| | primary - bf16 [95% CI] "
    "| gradient cosine (one batch) |",
    "|---|---:|---:|---:|---|---:|",
  ]
  for p in points:
    cos = "-" if p["grad_cosine"] is None else f"{p['grad_cosine']:.3f}"
    lines.append(
      f"| {p['label']} | {p['runs']} | {p['kl']:.2e} | {p['abs_diff']:.2e} | "
      f"{_interval_text(dict(mean=p['diff'], lo=p['lo'], hi=p['hi']))} | {cos} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  rows = rows_of(FLAGS.runs, FLAGS.length)
  if not any(r["recipe"] == BASELINE for r in rows):
    raise app.UsageError(f"--runs: no finished {BASELINE} run under {FLAGS.runs}")
  extra = [r for d in FLAGS.exploratory for r in rows_of(d, FLAGS.length)]
  try:
    seen = tuple(int(x) for x in FLAGS.seen_seeds)
  except ValueError:
    raise app.UsageError(f"--seen_seeds: {FLAGS.seen_seeds} (accepted: integers, e.g. 0,1,2,3)")
  text, out = report(rows, extra, FLAGS.length, seen)
  print(text)
  if FLAGS.dose:
    out["dose"] = dose_points(rows + extra, out, FLAGS.dose, FLAGS.length, FLAGS.gradients)
    print("\n" + dose_table(out["dose"]))
    if FLAGS.dose_plot:
      from jetrl.study.plots import dose_response_figure  # pylint: disable=import-outside-toplevel

      dose_response_figure(out["dose"], FLAGS.dose_plot)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
