"""The fourth round's report lays out prereg4's verdicts: its numbers are checked against
intervals computed here by hand (numpy float64 and scipy's t quantile), its words against the
calls' definitions."""

import math

import numpy as np
import pytest
from scipy import stats

from jetrl.study import prereg4
from jetrl.study import round4_report as report


def _t(d):
  d = np.asarray(d, np.float64)
  n, m = len(d), d.mean()
  half = stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n)
  return m, m - half, m + half


def _row(recipe, warm, seed, acc):
  return dict(
    part="primary",
    recipe=recipe,
    warm=warm,
    seed=seed,
    length=9,
    eval_steps=[0, 10, 20, 30],
    eval_accuracy=[0.2, acc, acc, acc],
    eval_accuracy_bf16=[0.2, acc, acc, acc],
    step_series=list(range(1, 31)),
    reward_series=[acc + 0.001 * s * (seed + 1) for s in range(30)],
    abs_diff_mean=0.0,
  )


def test_the_band_is_each_steps_t_interval_over_seeds():
  series = [[0.1, 0.5, 0.9], [0.2, 0.4, 0.9], [0.3, 0.9, 0.3]]
  mean, lo, hi = report._band(series)
  for j in range(3):
    m, a, b = _t([s[j] for s in series])
    assert mean[j] == pytest.approx(m) and lo[j] == pytest.approx(a) and hi[j] == pytest.approx(b)
  # one seed: the mean alone, no interval
  mean, lo, hi = report._band([[0.1, 0.2]])
  assert list(lo) == list(mean) == list(hi) == [0.1, 0.2]


@pytest.mark.parametrize(
  "lo, hi, expected",
  [
    (-0.031, 0.02, "a drop of up to 3.1 points is not excluded"),
    (0.004, 0.05, "nothing at this margin"),
    (-0.08, 0.01, "the interval crosses -5"),
    (-0.2, -0.07, "a drop of more than 5 points is shown"),
  ],
)
def test_what_is_open_follows_the_interval(lo, hi, expected):
  c = prereg4.call(dict(n=9, mean=(lo + hi) / 2, lo=lo, hi=hi, p=0.5))
  assert expected in report.what_is_open(c)


def test_the_summary_table_states_the_primary_interval_call_and_progress():
  diffs = {(w, s): 0.01 * ((3 * s + w) % 4) - 0.02 for w in range(3) for s in range(3)}
  rows = []
  for (w, s), d in diffs.items():
    rows += [
      _row("bf16", w, s, 0.4),
      _row("bf16@recompute", w, s, 0.39),
      _row("jet", w, s, 0.4 + d),
    ]
  verdicts = dict(
    primary={o: prereg4.judge_primary(rows, 9, o) for o in prereg4.OUTCOMES},
    crossover={o: prereg4.judge_crossover([], 9, o) for o in prereg4.OUTCOMES},
    length={o: prereg4.judge_length([], 20, o) for o in prereg4.OUTCOMES},
    smollm2=prereg4.judge_smollm2([]),
    primary_warm_starts=dict(used=[0, 16, 17], left_out_by_the_gate=list(range(1, 16))),
    progress=dict(
      primary=dict(done=27, planned=81),
      crossover=dict(done=0, planned=40),
      length=dict(done=0, planned=18, note="not run: its warm start failed the gate (0.05)"),
    ),
  )
  table = report.summary_table(verdicts)
  m, lo, hi = _t(list(diffs.values()))
  primary = [line for line in table.splitlines() if "(primary)" in line][0]
  assert f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] (n = 9)" in primary
  assert "**non-inferior**" in primary and f"up to {-100 * lo:.1f} points" in primary
  # bf16 - bf16@recompute is +1 point on every unit: the line says so
  rc = [line for line in table.splitlines() if "`bf16` - `bf16@recompute`" in line][0]
  assert "+1.0 [+1.0, +1.0]" in rc
  assert "the 3 of 18 SFT seeds that answer at length 9" in table
  assert "| 0 of 40 runs | not judged |" in table
  assert "not run: its warm start failed the gate" in table
  md = report.results_markdown(verdicts, [], "python experiments/round4.py", "abc" * 14)
  assert "**Interim:** primary: 27 of 81 runs" in md and table in md


def test_rl_effect_is_each_arms_change_from_its_own_start():
  # warm start 0: accuracy rises by 0.1 + 0.01 s; warm start 1: it falls by 0.05 + 0.02 s
  rows = []
  for s in range(4):
    for w, change in ((0, 0.1 + 0.01 * s), (1, -0.05 - 0.02 * s)):
      r = _row("bf16", w, s, 0.3 + change)
      r["eval_accuracy_bf16"] = [0.3, 0.3 + change, 0.3 + change, 0.3 + change]
      rows.append(r)
  eff = report.rl_effect(rows)
  m, lo, hi = _t([0.1 + 0.01 * s for s in range(4)])
  assert eff["0"]["bf16"]["mean"] == pytest.approx(m) and eff["0"]["bf16"]["lo"] == pytest.approx(
    lo
  )
  assert eff["1"]["bf16"]["hi"] == pytest.approx(_t([-0.05 - 0.02 * s for s in range(4)])[2])
  assert eff["0"]["bf16"]["start"] == pytest.approx(0.3)
  text = report._rl_effect_text(dict(primary_rl_effect=eff))
  assert "raised held-out accuracy on w0" in text and "lowered held-out accuracy on w1" in text


def test_figures_are_written_for_the_parts_that_have_runs(tmp_path):
  rows = [_row(a, w, s, 0.3 + 0.01 * s) for a in ("bf16", "jet") for w in (0, 1) for s in range(3)]
  smol = [
    dict(recipe=r, seed=s, before=0.2, after=0.3, curve=[(0, 0.2), (12, 0.25), (24, 0.3)])
    for r in ("bf16", "jet")
    for s in range(3)
  ]
  made = report.write_figures(rows, smol, {}, str(tmp_path))
  names = sorted(p.split("/")[-1] for p in made)
  assert names == ["primary_curves.png", "smollm2_curves.png"]
  for p in made:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_readme_and_the_study_page_state_the_committed_round4_summary():
  """README's and docs/precision_study.md's round-4 table is the one the report computes from
  the committed verdicts (docs/study/round4/verdicts.json), line for line."""
  import json
  import os

  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(repo, "docs", "study", "round4", "verdicts.json")) as f:
    table = report.summary_table(json.load(f))
  for doc in ("README.md", os.path.join("docs", "precision_study.md")):
    with open(os.path.join(repo, doc)) as f:
      text = f.read()
    missing = [line for line in table.splitlines() if line not in text]
    assert not missing, f"{doc} lacks the report's lines: {missing}"
