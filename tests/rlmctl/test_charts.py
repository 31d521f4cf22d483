"""The acceptance report's charts looked at as images: the PNGs `rlmctl accept` writes where
matplotlib is installed are read back as pixels (the threshold line's colour is there, across the
plot), the figures' own layout is measured with matplotlib's renderer (legend inside the canvas,
four or more labelled ticks per axis), and the SVG drawn without matplotlib is checked for the
same parts. tests/packaging/test_torch_free_install.py shows that a controller without
matplotlib draws SVG."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rlmctl import accept, charts
from runcontract.rundir import RunDir
from tests.rlmctl.test_accept import LIMITS, make_run

matplotlib = pytest.importorskip("matplotlib")  # the `[train]` extra; `make venv` installs it

DEPTHS = (1, 2, 4, 8, 16, 32)


def val_passes(count: int) -> list[dict[str, float]]:
    """Perplexity per depth that falls with training, and whose gain from depth grows with it."""
    return [
        {str(d): 30.0 / (1 + i) * (1 + 2.0 / (1 + i * math.log2(d))) for d in DEPTHS}
        for i in range(count)
    ]


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    run_dir = make_run(tmp_path, steps=800, val=val_passes(8), checkpoints=())
    for step in (100, 300, 500, 800):
        run_dir.append_event("checkpoint", step=step)
    return run_dir


def report_charts(run_dir: RunDir) -> list[charts.Chart]:
    verdict = accept.evaluate("r", run_dir, LIMITS, None, None, "nowhere")
    return accept.charts(run_dir, verdict.criteria)


def rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def test_the_report_has_pngs_with_the_threshold_drawn_across(run_dir: RunDir) -> None:
    from matplotlib import image

    verdict = accept.evaluate("r", run_dir, LIMITS, None, None, "nowhere")
    accept.write_report(verdict, run_dir, [])
    text = (run_dir.path / "acceptance.md").read_text()
    names = ("loss", "val-perplexity", "perplexity-by-depth", "tflops")
    assert [Path(p).name for p in verdict.plots] == [f"{n}.png" for n in names]
    for name in names:
        assert f"![{name}](acceptance/{name}.png)" in text
    pixels = image.imread(run_dir.path / "acceptance" / "tflops.png")[:, :, :3]
    assert pixels.shape[1] >= 700  # 7 in at 110 dpi
    red = (abs(pixels - rgb(charts.THRESHOLD_COLOR)).max(axis=2) < 0.08).sum(axis=1)
    # A dashed line across the plot: one pixel row is red over more than a third of the width.
    assert red.max() > pixels.shape[1] / 3, red.max()
    # ... and not in the other charts, which have no threshold: red is for thresholds only.
    loss = image.imread(run_dir.path / "acceptance" / "loss.png")[:, :, :3]
    assert (abs(loss - rgb(charts.THRESHOLD_COLOR)).max(axis=2) < 0.08).sum() == 0


def test_every_chart_has_four_labelled_ticks_and_its_legend_inside(run_dir: RunDir) -> None:
    drawn = report_charts(run_dir)
    assert len(drawn) == 4
    for chart in drawn:
        fig = charts.figure(chart)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            labelled = [
                t.get_text()
                for t, at in zip(axis.get_ticklabels(), axis.get_ticklocs(), strict=True)
                if t.get_text() and min(lo, hi) <= at <= max(lo, hi)
            ]
            assert len(labelled) >= 4, (chart.name, labelled)
        (legend,) = fig.legends
        box, canvas = legend.get_window_extent(renderer), fig.bbox
        assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1, (chart.name, box, canvas)
        assert canvas.y0 <= box.y0 and box.y1 <= canvas.y1, (chart.name, box, canvas)
        # the legend does not lie over the plot
        assert not box.overlaps(ax.get_window_extent(renderer)), chart.name
        for line, points in zip(ax.get_lines(), chart.series.values(), strict=False):
            marked = line.get_marker() not in ("None", None, "")
            assert marked == (len(points) <= charts.MAX_MARKED), (chart.name, line.get_label())


def test_equal_series_stay_visible_on_top_of_each_other() -> None:
    same = [(float(x), 2.0 * x) for x in range(10)]
    fig = charts.figure(charts.Chart("same", "t", "x", "y", {"a": same, "b": list(same)}))
    first, second = fig.axes[0].get_lines()
    # the later series is drawn on top and smaller: the earlier one's marker rings stay seen
    assert second.get_zorder() > first.get_zorder()
    assert second.get_markersize() < first.get_markersize()
    assert first.get_marker() != second.get_marker()


def test_perplexity_against_depth_has_one_line_per_checkpoint(run_dir: RunDir) -> None:
    curves = accept.depth_curves(accept.RunData.load(run_dir))
    # val passes at steps 100..800; checkpoints at 100, 300, 500 and 800
    assert [label.split(" (")[0] for label in curves] == [
        "step 100", "step 300", "step 500", "step 800"
    ]  # fmt: skip
    assert all([x for x, _ in curve] == list(map(float, DEPTHS)) for curve in curves.values())
    gains = [float(label.rsplit("= ", 1)[1].rstrip(")")) for label in curves]
    assert gains == sorted(gains) and gains[-1] > gains[0]  # depth pays more later on


def test_without_checkpoints_the_depth_chart_thins_the_validation_passes(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, val=val_passes(20), checkpoints=())
    steps = [label.split(" (")[0] for label in accept.depth_curves(accept.RunData.load(run_dir))]
    assert len(steps) == accept.MAX_DEPTH_CURVES
    assert steps[0] == "step 100" and steps[-1] == "step 2000"


def test_a_validation_pass_past_the_train_records_is_placed_by_tokens(tmp_path: Path) -> None:
    """metrics.jsonl with its train records cut short: once such a pass was drawn at its step
    number on the token axis, far left of its neighbours."""
    run_dir = make_run(tmp_path, steps=200, val=val_passes(3))  # passes at steps 100, 200, 300
    chart = next(c for c in report_charts(run_dir) if c.name == "val-perplexity")
    assert [x for x, _ in chart.series["depth 1"]] == [100_000, 200_000, 300_000]


def test_the_svg_drawing_has_ticks_a_threshold_line_and_a_legend_inside(run_dir: RunDir) -> None:
    for chart in report_charts(run_dir):
        root = ET.fromstring(charts.svg(chart))
        width, height = float(root.get("width", 0)), float(root.get("height", 0))
        texts = {
            kind: [
                t for t in root.iter("{http://www.w3.org/2000/svg}text") if t.get("class") == kind
            ]
            for kind in ("xtick", "ytick", "legend")
        }
        assert len(texts["xtick"]) >= 4 and len(texts["ytick"]) >= 4, chart.name
        labels = [t.text for t in texts["legend"]]
        assert labels == [*chart.series, *(t.label for t in chart.thresholds)]
        for text in texts["legend"]:
            x, y = float(text.get("x", 0)), float(text.get("y", 0))
            assert x >= 0 and x + charts.CHAR_W * len(text.text or "") <= width, chart.name
            assert charts.TOP + charts.PLOT_HEIGHT < y <= height, chart.name
        lines = [
            line for line in root.iter("{http://www.w3.org/2000/svg}line")
            if line.get("class") == "threshold"
        ]  # fmt: skip
        assert len(lines) == len(chart.thresholds), chart.name
        if chart.thresholds:
            (line,) = lines
            assert line.get("stroke") == charts.THRESHOLD_COLOR
            assert charts.TOP <= float(line.get("y1", -1)) <= charts.TOP + charts.PLOT_HEIGHT


def test_nice_ticks_cover_the_data_with_round_steps() -> None:
    assert charts.nice_ticks(0, 1000) == [0, 200, 400, 600, 800, 1000]
    ticks = charts.nice_ticks(3.2, 3.3)
    assert len(ticks) >= 4 and ticks[0] <= 3.2 and ticks[-1] >= 3.3
    assert len(charts.nice_ticks(5.0, 5.0)) >= 4  # a flat series still gets an axis
    assert charts.log_ticks(12, 900) == [10, 20, 50, 100, 200, 500, 1000]
