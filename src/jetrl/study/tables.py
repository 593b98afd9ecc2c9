"""The study's tables (markdown): accuracy, with the paired intervals against bf16, and the
rollout/training mismatch, one row per arm."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jetrl.study.stats import BASELINE


ACCURACY_HEADER = (
  "| recipe | seeds | acc @0 own / bf16 | final acc own | final acc bf16-scored | "
  "gain (bf16-scored) [95% CI] | − bf16, bf16-scored [95% CI], p | − bf16, own [95% CI] | "
  "diverged |"
)
MISMATCH_HEADER = (
  "| recipe | mean \\|Δlog p\\| | max \\|Δlog p\\| | mean \\|ΣΔlog p\\| per seq. | "
  "max \\|ΣΔlog p\\| | k3 KL | tokens outside [0.8, 1.2] | resp. len | "
  "rollout s/step | update s/step | wall s/run |"
)
TABLE_HEADER = ACCURACY_HEADER


def fmt(x, spec=".3f") -> str:
  """`x` formatted by `spec`; a dash for None or NaN."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  return format(x, spec)


def _ci(c: dict, p: bool = False) -> str:
  if c["n"] == 0:
    return "–"
  if c["n"] < 2:
    return f"{c['mean']:+.3f}"
  out = f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"
  return out + (f", p={c['p']:.2g}" if p else "")


def _pm(mean, sd, n):
  return fmt(mean) + (f" ± {sd:.3f}" if n > 1 and sd == sd else "")


def _sep(header: str) -> str:
  return "|" + "---|" * header.count(" | ") + "---|"


def format_table(agg_rows: Sequence[dict], target: float = 0.5) -> str:
  """The accuracy table (mean ± sample std over seeds; paired intervals against bf16)."""
  del target
  lines = [ACCURACY_HEADER, _sep(ACCURACY_HEADER)]
  for a in agg_rows:
    div = f"{a['n_diverged']}/{a['n_seeds']}" + (
      f" ({', '.join(a['diverged_why'])})" if a["diverged_why"] else ""
    )
    base = a["recipe"] == BASELINE
    lines.append(
      f"| {a['recipe']} | {a['n_seeds']} | {fmt(a['eval_initial'])} / "
      f"{fmt(a['eval_initial_bf16'])} | {_pm(a['eval_final'], a['eval_final_sd'], a['n_seeds'])} "
      f"| {_pm(a['eval_final_bf16'], a['eval_final_bf16_sd'], a['n_seeds'])} | "
      f"{_ci(a['gain_bf16'])} | {'–' if base else _ci(a['vs_bf16'], p=True)} | "
      f"{'–' if base else _ci(a['vs_bf16_own'])} | {div} |"
    )
  return "\n".join(lines)


def format_mismatch_table(agg_rows: Sequence[dict]) -> str:
  """The rollout/training mismatch table (means over steps, then over seeds)."""
  lines = [MISMATCH_HEADER, _sep(MISMATCH_HEADER)]
  for a in agg_rows:
    lines.append(
      f"| {a['recipe']} | {fmt(a['abs_diff_mean'], '.2e')} | {fmt(a['abs_diff_max'], '.2f')} | "
      f"{fmt(a['seq_abs_sum_mean'], '.2e')} | {fmt(a['seq_abs_sum_max'], '.2f')} | "
      f"{fmt(a['kl_k3'], '.2e')} | {fmt(a['ratio_out_frac'], '.2e')} | "
      f"{fmt(a['response_length'], '.1f')} | {fmt(a['time_rollout'], '.2f')} | "
      f"{fmt(a['time_update'], '.2f')} | {fmt(a['wall_s'], '.0f')} |"
    )
  return "\n".join(lines)
