"""Every GPU check in one command: the test suite, jetrl's device benchmark and the peers.

  PYTHONPATH=src python3 experiments/gpu_check.py --out=/tmp/gpu_check \
      --peers=path/to/gpu_peers.py --budget_s=480

Runs, each in its own process with its own time limit, in this order:
  bench  experiments/bench_device.py (FP8 GEMMs, rollout, update, one RL step) -> bench_device.json
  bench2 the device benchmark once more with --bench2_flags (other settings in a process of
         their own, such as other XLA flags: the decode loop with command buffers that capture
         `while` loops) -> bench_device_2.json
  peers  the peers script on the same shapes (torch bf16 and cuBLAS blockwise FP8 GEMMs,
         HF transformers `generate`), when --peers names it -> peers.json
  tests  `pytest -m "not slow"` over tests/ (GPU-only tests run; CPU-only ones skip)
and writes gpu_check.json (everything, with the command lines and durations), summary.md (the
tables that put jetrl and the peers side by side: ratios only within this run mean anything)
and one log per part into --out. Each part's share of the budget is a flag; a part that runs
out of time is stopped and reported as such, and the rest still runs.
"""

from __future__ import annotations

import json
import re
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for the JSON, logs and summary.", required=True)
flags.DEFINE_string("peers", "", "Path of the peers script (torch / HF on the same shapes).")
flags.DEFINE_list("parts", ["bench", "peers", "tests"], "Parts to run, in this order.")
flags.DEFINE_float("budget_s", 480.0, "Wall-clock budget for all parts together.")
flags.DEFINE_float("bench_share", 0.55, "Share of the budget for the device benchmark.")
flags.DEFINE_float("peers_share", 0.15, "Share of the budget for the peers.")
flags.DEFINE_string("bench_flags", "", "Extra flags for bench_device.py (shell words).")
flags.DEFINE_string("bench2_flags", "", "Flags for the second bench_device.py run (shell words).")
flags.DEFINE_float("bench2_share", 0.2, "Share of the budget for the second device benchmark.")
flags.DEFINE_string("peers_ms", "4096,16384,64", "Token counts M of the peers' GEMMs.")
flags.DEFINE_string("peers_sections", "gemm,generate", "Peers' parts.")
flags.DEFINE_string(
  "pytest_args",
  "-n 12 -v -m 'not slow' tests",
  "What pytest runs (shell words; keep -v, so that failures are named as they "
  "happen; -n needs pytest-xdist, which the GPU image has).",
)
flags.DEFINE_integer("test_timeout_s", 150, "Per-test time limit (pytest-timeout, if present).")

ROOT = Path(__file__).resolve().parent.parent
_T0 = time.perf_counter()


def left() -> float:
  return FLAGS.budget_s - (time.perf_counter() - _T0)


def run_part(name: str, cmd: list[str], limit_s: float, out: Path, env=None) -> dict:
  """Run cmd with output to out/<name>.log, stopped after limit_s; a record of what happened."""
  log = out / f"{name}.log"
  t0 = time.perf_counter()
  rec = dict(part=name, cmd=" ".join(cmd), limit_s=round(limit_s))
  print(f"[gpu_check] {name}: {rec['cmd']}  (limit {limit_s:.0f} s)", flush=True)
  if limit_s < 10:
    return dict(rec, status="skipped: no time left")
  with open(log, "w", encoding="utf-8") as f:
    proc = subprocess.Popen(
      cmd,
      stdout=f,
      stderr=subprocess.STDOUT,
      cwd=ROOT,
      env=env or os.environ.copy(),
      start_new_session=True,
    )
    try:
      rc = proc.wait(timeout=limit_s)
      status = "ok" if rc == 0 else f"exit code {rc}"
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
      status = f"stopped at its {limit_s:.0f} s limit"
  rec.update(status=status, seconds=round(time.perf_counter() - t0, 1))
  print(f"[gpu_check] {name}: {status} after {rec['seconds']} s", flush=True)
  return rec


def _env(**extra) -> dict:
  env = os.environ.copy()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env


def environment() -> dict:
  info = dict(python=sys.version.split()[0])
  try:
    info["nvidia_smi"] = subprocess.run(
      [
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
        "--format=csv,noheader",
      ],
      capture_output=True,
      text=True,
      timeout=30,
    ).stdout.strip()
  except (OSError, subprocess.TimeoutExpired) as e:
    info["nvidia_smi"] = f"unavailable: {e}"
  for mod in ("jax", "jaxlib", "torch", "transformers", "triton"):
    try:
      r = subprocess.run(
        [sys.executable, "-c", f"import {mod}; print({mod}.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
      )
      info[mod] = r.stdout.strip() or r.stderr.strip().splitlines()[-1][:200]
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
      info[mod] = f"? ({e})"
  return info


def pytest_summary(log: Path) -> dict:
  """The counts line and the failed tests' ids from a pytest log."""
  if not log.exists():
    return {}
  lines = log.read_text(errors="replace").splitlines()
  counts = next(
    (
      ln.strip("= ")
      for ln in reversed(lines)
      if (" passed" in ln or " failed" in ln) and (" in " in ln)
    ),
    "",
  )
  # Summary lines ("FAILED path::test - msg"), -v progress lines ("path::test FAILED") and
  # xdist's ("[gw0] [ 12%] FAILED path::test"): a run stopped before its summary still names them.
  failed = []
  for ln in lines:
    m = re.search(r"\b(?:FAILED|ERROR) (\S+::\S+)", ln) or re.search(
      r"^(\S+::\S+) (?:FAILED|ERROR)", ln
    )
    if m and m.group(1) not in failed:
      failed.append(m.group(1))
  return dict(counts=counts, failed=failed)


def _load(path: Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _fmt(v, spec=".0f"):
  return "-" if v is None else format(v, spec)


def _profile_table(bench) -> list[str]:
  """The kernels of the profiled rollouts and updates (bench_device.py --profile)."""
  rows = []
  for part, per in (("rollout", "decode step"), ("update", "step")):
    for r in (bench or {}).get(part) or []:
      p = r.get("profile")
      if not p:
        continue
      setting = (
        f"{r.get('batch')}x{r.get('prompt_len')}+{r.get('new_tokens')}"
        if part == "rollout"
        else f"{r.get('rows')}x{r.get('seq')}"
      )
      if not p.get("kernels"):
        rows.append(f"| {part} | {r.get('recipe')} | {setting} | {p.get('note', '-')} | | | |")
        continue
      top = p["top"][0] if p.get("top") else {}
      rows.append(
        f"| {part} | {r.get('recipe')} | {setting} | {p['kernels_per_step']:.0f} a {per} | "
        f"{p['mean_kernel_us']:.1f} | {100 * p['busy_share']:.0f}% | "
        f"`{top.get('name', '-')[:60]}` ({100 * top.get('share', 0):.0f}%) |"
      )
  if not rows:
    return []
  return [
    "## Kernels (one profiled call each; busy: kernel time / first-to-last span)",
    "",
    "| part | recipe | setting | kernels | mean kernel (us) | busy | top kernel (share) |",
    "|---|---|---|---|---|---|---|",
    *rows,
    "",
  ]


def summary(bench, peers, tests) -> str:
  """Markdown tables: jetrl next to the peers, measured in this one run."""
  out = []
  if bench and bench.get("gemm"):
    peer_rows = {}
    for r in (peers or {}).get("gemm", []) if isinstance(peers, dict) else []:
      # The same layer's measurement where the peers name it, else one of the same shape.
      peer_rows[(r.get("model"), r.get("layer"), r["m"], r["k"], r["n"])] = r
      peer_rows.setdefault((r["m"], r["k"], r["n"]), r)
    out += [
      "## GEMMs (TFLOP/s; x = speed-up over XLA bf16 in this run)",
      "",
      "| model | layer | M x K x N | XLA bf16 | jetrl cuBLASLt FP8 | `linear` (jet) "
      "| `linear`, one-pass quant | fwd+bwd jet / bf16 | same, one-pass quant "
      "| quantize x (us): XLA / one-pass | torch bf16 | torch cuBLAS blockwise FP8 |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["gemm"]:
      if "skipped" in r:
        continue
      t = lambda key: r.get(key, {}).get("tflops")
      sp = lambda key: r.get(key, {}).get("speedup_vs_bf16")
      us = lambda key: r.get(key, {}).get("us")
      shape = (r["m"], r["k"], r["n"])
      p = peer_rows.get((r["model"], r["layer"]) + shape) or peer_rows.get(shape, {})
      pt = lambda key: (p.get(key) or {}).get("tflops") if isinstance(p.get(key), dict) else None
      out.append(
        f"| {r['model']} | {r['layer']} | {r['m']}x{r['k']}x{r['n']} | {_fmt(t('bf16'))} | "
        f"{_fmt(t('fp8_cublaslt'))} ({_fmt(sp('fp8_cublaslt'), '.2f')}x) | "
        f"{_fmt(t('linear'))} ({_fmt(sp('linear'), '.2f')}x) | "
        f"{_fmt(t('linear_fq'))} ({_fmt(sp('linear_fq'), '.2f')}x) | "
        f"{_fmt(sp('train_jet'), '.2f')}x | {_fmt(sp('train_jet_fq'), '.2f')}x | "
        f"{_fmt(us('quantize_x'), '.1f')} / {_fmt(us('quantize_x_fq'), '.1f')} | "
        f"{_fmt(pt('bf16'))} | {_fmt(pt('fp8_block'))} |"
      )
    out.append("")
    timed = [
      r for r in bench["gemm"] if any("kernel_us" in v for v in r.values() if isinstance(v, dict))
    ]
    if timed:
      names = [
        v for v in ("bf16", "fp8_cublaslt", "linear", "linear_fq") if any(v in r for r in timed)
      ]
      names += sorted({v for r in timed for v in r if v.startswith("fp8_pallas")})
      out += [
        "## Decode-size GEMMs: device time of a call's kernels (us; profiler, in a loop)",
        "",
        "| model | layer | M x K x N | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
      ]
      for r in timed:
        cells = [_fmt((r.get(v) or {}).get("kernel_us"), ".1f") for v in names]
        out.append(
          f"| {r['model']} | {r['layer']} | {r['m']}x{r['k']}x{r['n']} | "
          + " | ".join(cells)
          + " |"
        )
      out.append("")
  for key, title, cols in (
    (
      "rollout",
      "Rollout",
      (
        "recipe",
        "batch",
        "prompt_len",
        "new_tokens",
        "tokens_per_s",
        "ms_per_step",
        "compile_s",
        "speedup_vs_bf16",
        "peak_gib",
      ),
    ),
    (
      "update",
      "Update step",
      (
        "recipe",
        "rows",
        "seq",
        "seconds",
        "tokens_per_s",
        "mfu_6nd",
        "remat",
        "speedup_vs_bf16",
        "peak_gib",
      ),
    ),
    (
      "e2e",
      "One RL step",
      (
        "recipe",
        "prompts",
        "group",
        "new_tokens",
        "seconds",
        "rollout_s",
        "reward_s",
        "update_s",
        "speedup_vs_bf16",
      ),
    ),
  ):
    rows = (bench or {}).get(key) or []
    if not rows:
      continue
    out += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
      cells = []
      for c in cols:
        v = r.get(c, r.get("skipped", "") if c == cols[-1] else "")
        cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
      out.append("| " + " | ".join(cells) + " |")
    out.append("")
  out += _profile_table(bench)
  gen = (peers or {}).get("generate") if isinstance(peers, dict) else None
  if gen:
    out += [
      f"HF transformers generate (bf16, {gen.get('batch')} x {gen.get('prompt_len')} + "
      f"{gen.get('new_tokens')}): {_fmt(gen.get('tokens_per_s'))} tok/s",
      "",
    ]
  if tests:
    out += ["## Tests", "", f"{tests.get('counts', '?')}", ""]
    out += [f"- FAILED {f}" for f in tests.get("failed", [])[:60]]
  return "\n".join(out) + "\n"


PARTS = ("bench", "bench2", "peers", "tests")


def main(argv):
  del argv
  unknown = [p for p in FLAGS.parts if p not in PARTS]
  if unknown:  # before anything runs: device time is precious
    raise app.UsageError(f"--parts: unknown {unknown}; accepted: {', '.join(PARTS)}")
  out = Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  result = dict(environment=environment(), parts=[])
  print(f"[gpu_check] {result['environment']}", flush=True)
  bench_json, peers_json = out / "bench_device.json", out / "peers.json"
  bench2_json = out / "bench_device_2.json"
  n_parts = len(FLAGS.parts)
  for i, part in enumerate(FLAGS.parts):
    if part in ("bench", "bench2"):  # the device benchmark, or its second run
      share, extra = (
        (FLAGS.bench_share, FLAGS.bench_flags)
        if part == "bench"
        else (FLAGS.bench2_share, FLAGS.bench2_flags)
      )
      limit = min(left(), FLAGS.budget_s * share)
      cmd = [
        sys.executable,
        "experiments/bench_device.py",
        f"--json_out={bench_json if part == 'bench' else bench2_json}",
        f"--time_budget_s={max(30.0, limit - 25):.0f}",
      ] + shlex.split(extra)
      result["parts"].append(run_part(part, cmd, limit, out, _env()))
    elif part == "peers":
      if not FLAGS.peers or not Path(FLAGS.peers).exists():
        result["parts"].append(
          dict(part="peers", status=f"skipped: no peers script ({FLAGS.peers or 'none given'})")
        )
        continue
      limit = min(left(), FLAGS.budget_s * FLAGS.peers_share)
      cmd = [
        sys.executable,
        FLAGS.peers,
        "--out",
        str(peers_json),
        "--ms",
        FLAGS.peers_ms,
        "--sections",
        FLAGS.peers_sections,
      ]
      result["parts"].append(run_part("peers", cmd, limit, out, _env()))
    elif part == "tests":
      limit = left() - 5 if i == n_parts - 1 else left() / (n_parts - i)
      # -v (not -q): a run stopped at its limit still names each failed test in its log.
      cmd = [sys.executable, "-m", "pytest", "-rfE", "-p", "no:cacheprovider"]
      try:
        import pytest_timeout  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

        cmd.append(f"--timeout={FLAGS.test_timeout_s}")
      except ImportError:
        pass
      cmd += shlex.split(FLAGS.pytest_args)
      rec = run_part("tests", cmd, limit, out, _env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))
      rec.update(pytest_summary(out / "tests.log"))
      result["parts"].append(rec)
  result["bench"], result["peers"] = _load(bench_json), _load(peers_json)
  result["bench2"] = _load(bench2_json)
  tests = next((p for p in result["parts"] if p["part"] == "tests"), None)
  text = summary(result["bench"], result["peers"], tests)
  (out / "summary.md").write_text(text)
  with open(out / "gpu_check.json", "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, default=str)
  print("\n" + text)
  for p in result["parts"]:
    print(
      f"[gpu_check] {p['part']:<6} {p.get('status')}  {p.get('seconds', '')} s  "
      f"{p.get('counts', '')}"
    )
  return 0


if __name__ == "__main__":
  app.run(main)
