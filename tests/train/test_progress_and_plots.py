"""The console's ETA leaves out the compiling step; the plots label their axes, keep legends
off the data, use linear axes for a few bins and keep a compiling step from dominating."""

import io
import json

import matplotlib.image as plt_image
import pytest

from jetrl.train import plots
from jetrl.train.writers import Progress


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_eta_is_measured_after_the_first_step():
  clock, out = Clock(), io.StringIO()
  progress = Progress(total=10, start=0, stream=out, clock=clock)
  clock.now = 100.0  # step 1 compiled: 100 s
  progress.update(1, {"loss": 1.0})
  clock.now = 102.0
  progress.update(2, {"loss": 1.0})
  clock.now = 106.0
  progress.update(4, {"loss": 1.0})
  lines = out.getvalue().splitlines()
  assert "100s elapsed, ETA at the next line (this one includes compilation)" in lines[0]
  assert "ETA 16s" in lines[1]  # 2 s per step x 8 steps left (not 51 s per step)
  assert "ETA 12s" in lines[2]  # (106 - 100) / 3 steps x 6 left
  # A resumed run counts from its own first step.
  resumed = Progress(total=10, start=6, stream=out, clock=clock)
  clock.now = 150.0
  resumed.update(7, {})
  clock.now = 151.0
  resumed.update(8, {})
  assert out.getvalue().splitlines()[-1].endswith("ETA 2s")


def test_scales_and_bin_labels():
  assert not plots.use_log_scale([1e-3, 2e-3, 5e-3])
  assert plots.use_log_scale([1e-5, 1e-3])
  assert not plots.use_log_scale([0.0, 1e-3])  # zeros are left out; one value is not a span
  assert plots.bin_labels([0, 16, 32]) == ["0-15", "16-31", "32+"]


def test_run_plots(tmp_path, monkeypatch):
  recs = []
  for step in range(1, 7):
    recs.append(
      {
        "step": step,
        "reward_mean": 0.1 * step,
        "accuracy": 0.1 * step,
        "agree/abs_diff_mean": 1e-3,
        "agree/abs_diff_max": 0.2,
        "agree/kl_k3": 1e-5,
        "agree/bin_abs_diff_mean": [1e-3, 2e-3, 3e-3],
        "agree/bin_count": [5, 5, 5],
        "agree/bin_edges": [0, 16, 32],
        "time/rollout": 1.0,
        "time/reward": 0.1,
        "time/update": 1.0 if step > 1 else 60.0,
        "time/compiled": float(step == 1),
      }
    )
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  (tmp_path / "eval.jsonl").write_text(
    '{"step": 0, "eval_accuracy": 0.5}\n{"step": 6, "eval_accuracy": 0.7}\n'
  )
  figures = {}
  real_save = plots.save

  def keep(fig, path):
    figures[path.rsplit("/", 1)[-1]] = fig
    return real_save(fig, path)

  monkeypatch.setattr(plots, "save", keep)
  paths = plots.write_plots(str(tmp_path))
  assert sorted(figures) == ["agreement.png", "agreement_by_position.png", "reward.png", "time.png"]
  assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in figures)
  assert len(paths) == 4
  for name, fig in figures.items():
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel(), name
    legend = ax.get_legend()
    if legend is not None:  # anchored right of the axes, outside the data
      assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1, name
  for name, fig in figures.items():  # 10 x 5 inches at 100 dpi
    assert tuple(fig.get_size_inches()) >= (10.0, 5.0) and fig.dpi >= 100, name
  height, width = plt_image.imread(tmp_path / "plots" / "reward.png").shape[:2]
  assert width >= 1000 and height >= 450
  # Train reward and accuracy are equal here and still two lines, told apart in the legend,
  # which says that they coincide.
  reward_ax = figures["reward.png"].axes[0]
  coincide = "train accuracy (equal to train reward at every step: the two lines coincide)"
  train = {line.get_label(): line for line in reward_ax.get_lines()}
  a, b = train["train reward"], train[coincide]
  assert (a.get_color(), a.get_linestyle()) != (b.get_color(), b.get_linestyle())
  assert a.get_linewidth() > b.get_linewidth() and b.get_marker() == "s"
  assert list(a.get_ydata()) == list(b.get_ydata())
  legend = [t.get_text() for t in reward_ax.get_legend().get_texts()]
  assert legend == ["train reward", coincide, "held-out greedy accuracy"]
  position = figures["agreement_by_position.png"].axes[0]
  assert position.get_xscale() == "linear" and position.get_yscale() == "linear"
  assert [t.get_text() for t in position.get_xticklabels()] == ["0-15", "16-31", "32+"]
  assert figures["agreement.png"].axes[0].get_yscale() == "log"  # 1e-5 .. 0.2
  time_ax = figures["time.png"].axes[0]
  assert time_ax.get_ylim()[1] == pytest.approx(1.3 * 2.1)  # the 61 s step is clipped ...
  assert any(t.get_text() == "61s (clipped)" for t in time_ax.texts)  # ... its height printed
  assert "includes compilation" in [t.get_text() for t in time_ax.get_legend().get_texts()]


def _reward_legend(tmp_path, monkeypatch, **kw):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "accuracy": 0.5}\n')
  (tmp_path / "eval.jsonl").write_text('{"step": 0, "eval_accuracy": 0.4}\n')
  figures = {}
  monkeypatch.setattr(plots, "save", lambda fig, path: figures.setdefault(path, fig) and path)
  plots.write_plots(str(tmp_path), **kw)
  (reward,) = [f for p, f in figures.items() if p.endswith("reward.png")]
  return [t.get_text() for t in reward.axes[0].get_legend().get_texts()]


def test_reward_plot_names_the_evaluation_temperature(tmp_path, monkeypatch):
  # No config.json: the evaluation is taken as greedy.
  assert _reward_legend(tmp_path, monkeypatch)[-1] == "held-out greedy accuracy"
  # The run's config.json says how it evaluated.
  config = {"eval": {"temperature": 0.7, "samples": 4, "size": 64}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert _reward_legend(tmp_path, monkeypatch)[-1] == "held-out accuracy at temperature 0.7 (x4)"
  config["eval"]["temperature"] = 0.0
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert _reward_legend(tmp_path, monkeypatch)[-1] == "held-out greedy accuracy"
  # The label a run passes wins.
  legend = _reward_legend(tmp_path, monkeypatch, eval_label="accuracy at temperature 1 (x2)")
  assert legend[0] == "train reward" and legend[1].startswith("train accuracy (equal to")
  assert legend[2] == "held-out accuracy at temperature 1 (x2)"


def test_agreement_plot_labels_its_floor_and_tells_its_lines_apart(tmp_path, monkeypatch):
  """k3 is 0 (and, in float32, slightly negative) at two steps: on the log axis those points sit on a floor line the legend names,
  with their count; the three series differ in line style and marker."""
  recs = [
    {"step": s, "agree/abs_diff_mean": 1e-7, "agree/abs_diff_max": 1e-5, "agree/kl_k3": k3}
    for s, k3 in ((1, 0.0), (2, 1e-9), (3, -2e-15))
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  figures = {}
  monkeypatch.setattr(plots, "save", lambda fig, path: figures.setdefault(path, fig) and path)
  plots.write_plots(str(tmp_path))
  (ax,) = [f for p, f in figures.items() if p.endswith("agreement.png")][0].axes
  assert ax.get_yscale() == "log"
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert legend == [
    "mean |Δ log p|",
    "max |Δ log p|",
    "k3 KL (2 steps at or below 1e-12: drawn on the floor)",
    "floor 1e-12",
  ]
  lines = {line.get_label(): line for line in ax.get_lines()}
  k3 = lines[legend[2]]
  assert list(k3.get_ydata()) == [1e-12, 1e-9, 1e-12]
  styles = {(line.get_linestyle(), line.get_marker()) for line in list(lines.values())[:3]}
  assert len(styles) == 3


def test_plots_leave_pyplot_as_they_found_it(tmp_path):
  """A run's plots are drawn off pyplot: its backend (a notebook's inline one) and its open
  figures are what they were, so the notebook's own `plt.show()` still draws (switching pyplot
  to Agg once made every later figure of the quickstart blank)."""
  import matplotlib
  import matplotlib.pyplot as pyplot

  before = matplotlib.get_backend()
  pyplot.switch_backend("svg")  # any backend but Agg
  try:
    mine = pyplot.figure()
    ax = plots.off_screen().subplots(figsize=plots.FIGSIZE)[1]
    ax.plot([0, 1], [1, 0])
    path = plots.save(ax.figure, str(tmp_path / "p.png"))
    assert plt_image.imread(path).ndim == 3  # an RGB(A) PNG
    assert matplotlib.get_backend() == "svg"
    assert pyplot.get_fignums() == [mine.number]
  finally:
    pyplot.close("all")
    pyplot.switch_backend(before)
