"""The acceptance report's charts: what to draw (`Chart`, built by rlmctl/accept.py from the run's
data) kept apart from how it is drawn. `render` draws a PNG with matplotlib where it is installed
(the `[train]` extra) and a self-contained SVG otherwise: a torch-free controller has no plotting
library, and its report still has readable charts.

Both drawings have the same parts: four or more labelled ticks per axis, threshold lines in one
colour no series uses, a marker on each series, later series drawn smaller on top of earlier ones
(a series equal to another stays visible), and the legend below the plot where it cannot be cut.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Red is kept for thresholds; the series take the rest of matplotlib's tab10.
THRESHOLD_COLOR = "#d62728"
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22")
# Early to late (one series per checkpoint): viridis without its pale yellow end.
RAMP = ("#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#9fda3a")
MARKERS = ("o", "s", "^", "D", "v", "P")
MAX_MARKED = 60  # a longer series (a step-by-step metric) is a plain line: markers would hide it


@dataclass
class Threshold:
    value: float
    label: str


@dataclass
class Chart:
    name: str  # file stem: <name>.png or <name>.svg
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]]
    thresholds: list[Threshold] = field(default_factory=list)
    log2_x: bool = False  # recurrence depths 1, 2, 4, ...
    ramp: bool = False  # the series are ordered in time: colours from dark (early) to light

    @property
    def empty(self) -> bool:
        return not any(self.series.values())

    def colors(self) -> list[str]:
        n = len(self.series)
        if self.ramp and n > 1:
            return [RAMP[round(i * (len(RAMP) - 1) / (n - 1))] for i in range(n)]
        return [COLORS[i % len(COLORS)] for i in range(n)]

    def log_y(self) -> bool:
        """Perplexity falls by orders of magnitude early on: a log axis past 1.5 decades."""
        ys = [y for points in self.series.values() for _, y in points]
        return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 30


def render(chart: Chart, directory: Path) -> Path:
    """`chart` drawn into `directory`: a PNG where matplotlib is installed, else an SVG."""
    try:
        import matplotlib  # noqa: F401  (only its presence is asked here)
    except ImportError:
        path = directory / f"{chart.name}.svg"
        path.write_text(svg(chart), encoding="utf-8")
        return path
    path = directory / f"{chart.name}.png"
    figure(chart).savefig(path, format="png")
    return path


# -- matplotlib --------------------------------------------------------------------------------
def figure(chart: Chart) -> Any:
    """The chart as a matplotlib Figure (Agg canvas: no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import (
        EngFormatter,
        FixedLocator,
        LogLocator,
        MaxNLocator,
        ScalarFormatter,
    )

    fig = Figure(figsize=(7.0, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for index, ((label, points), color) in enumerate(
        zip(chart.series.items(), chart.colors(), strict=True)
    ):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(
            xs, ys, label=label, color=color, linewidth=1.6,
            marker=MARKERS[index % len(MARKERS)] if len(points) <= MAX_MARKED else None,
            markersize=max(3.0, 8.0 - 1.2 * index), markerfacecolor="white", zorder=2 + index,
        )  # fmt: skip
    for threshold in chart.thresholds:
        ax.axhline(
            threshold.value, color=THRESHOLD_COLOR, linestyle="--", linewidth=1.6,
            label=threshold.label, zorder=1,
        )  # fmt: skip
    if chart.log2_x:
        ax.set_xscale("log", base=2)
        xs = sorted({x for points in chart.series.values() for x, _ in points})
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(FixedLocator([]))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10], min_n_ticks=4))
        if max(abs(x) for points in chart.series.values() for x, _ in points) >= 1e4:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # tokens: 200k, 1.5M, 3G
    if chart.log_y():
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10], min_n_ticks=4))
    ax.set_title(chart.title, fontsize=10)
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # As many columns as the widest entry allows (handle ~40 px, ~5.5 px a character at 8 pt):
        # one row of long labels would run off both sides of the canvas.
        entry_px = 44 + 5.5 * max(len(label) for label in labels)
        columns = max(1, min(len(handles), 4, int(fig.bbox.width * 0.95 // entry_px)))
        fig.legend(loc="outside lower center", ncols=columns, fontsize=8, frameon=False)
    return fig


# -- SVG fallback ------------------------------------------------------------------------------
WIDTH, PLOT_HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 72, 24, 34, 48  # room for tick labels, title and axis labels
CHAR_W, ROW_H = 6.6, 16  # font-size 11 sans-serif: a generous width per character


def nice_ticks(lo: float, hi: float, wanted: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi], at least four."""
    if hi <= lo:
        lo, hi = lo - (abs(lo) or 1) * 0.5, hi + (abs(hi) or 1) * 0.5
    for divisor in (wanted - 1, wanted, wanted + 2, wanted + 4):
        raw = (hi - lo) / divisor
        power = 10 ** math.floor(math.log10(raw))
        step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
        first = math.floor(lo / step) * step
        ticks = [first + i * step for i in range(math.ceil((hi - first) / step - 1e-9) + 1)]
        if len(ticks) >= 4:
            return [round(t, 12) for t in ticks]
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2, 5 × 10^k from below `lo` to above `hi`."""
    ticks = []
    for power in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10**power for m in (1, 2, 5)]
    below = [t for t in ticks if t <= lo]
    above = [t for t in ticks if t >= hi]
    return [t for t in ticks if (below[-1] if below else ticks[0]) <= t <= above[0]]


def _label(value: float) -> str:
    """Tokens run to billions: 200k, 1.5M, 3G rather than 2e+05."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(value) >= scale:
            return f"{value / (scale if suffix != 'k' else 1e3):.4g}{suffix}"
    return f"{value:.4g}"


def legend_rows(labels: list[str], width: float) -> list[list[tuple[float, int]]]:
    """(x offset, label index) per legend row: entries wrap before the canvas edge."""
    rows: list[list[tuple[float, int]]] = [[]]
    x = 0.0
    for index, label in enumerate(labels):
        entry = 34 + CHAR_W * len(label) + 14
        if rows[-1] and x + entry > width:
            rows.append([])
            x = 0.0
        rows[-1].append((x, index))
        x += entry
    return rows if rows[0] else []


def svg(chart: Chart) -> str:
    """The chart as a standalone SVG document (no plotting library)."""
    points = [p for values in chart.series.values() for p in values]
    if not points:
        return ""
    values_y = [y for _, y in points] + [t.value for t in chart.thresholds]
    log_y = chart.log_y() and min(values_y) > 0
    xs = sorted({x for x, _ in points})
    if chart.log2_x and xs[0] > 0:
        x_ticks = xs
        fx = math.log2
    else:
        x_ticks, fx = nice_ticks(xs[0], xs[-1]), float
    lo, hi = min(values_y), max(values_y)
    # 3% room: a threshold or a series at the data's edge is not drawn over the plot's frame
    pad = 0.03 * (hi - lo)
    padded = (lo - pad if lo - pad >= 0 or lo < 0 else 0.0, hi + pad)
    y_ticks = log_ticks(lo, hi) if log_y else nice_ticks(*padded)
    fy = math.log10 if log_y else float
    x0, x1 = fx(x_ticks[0]), fx(x_ticks[-1])
    y0, y1 = fy(y_ticks[0]), fy(y_ticks[-1])
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    plot_w = WIDTH - LEFT - RIGHT

    def sx(x: float) -> float:
        return LEFT + (fx(x) - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return TOP + PLOT_HEIGHT - (fy(y) - y0) / (y1 - y0) * PLOT_HEIGHT

    labels = list(chart.series) + [t.label for t in chart.thresholds]
    rows = legend_rows(labels, WIDTH - 2 * 12)
    height = TOP + PLOT_HEIGHT + BOTTOM + ROW_H * len(rows) + 8
    bottom = TOP + PLOT_HEIGHT
    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="13">{e(chart.title)}</text>',
    ]
    for tick in x_ticks:
        x = sx(tick)
        parts.append(
            f'<line class="grid" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" '
            'stroke="#e0e0e0"/>'
        )
        parts.append(
            f'<text class="xtick" x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">'
            f"{_label(tick)}</text>"
        )
    for tick in y_ticks:
        y = sy(tick)
        parts.append(
            f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
            'stroke="#e0e0e0"/>'
        )
        parts.append(
            f'<text class="ytick" x="{LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_label(tick)}</text>"
        )
    parts += [
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{PLOT_HEIGHT}" fill="none" '
        'stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{bottom + 36}" text-anchor="middle">'
        f"{e(chart.xlabel)}</text>",
        f'<text x="14" y="{TOP + PLOT_HEIGHT / 2}" transform="rotate(-90 14 '
        f'{TOP + PLOT_HEIGHT / 2})" text-anchor="middle">{e(chart.ylabel)}</text>',
    ]
    for threshold in chart.thresholds:
        y = sy(threshold.value)
        parts.append(
            f'<line class="threshold" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
            f'stroke="{THRESHOLD_COLOR}" stroke-width="1.6" stroke-dasharray="6 4"/>'
        )
    colors = chart.colors()
    for index, (values, color) in enumerate(zip(chart.series.values(), colors, strict=True)):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        parts.append(
            f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.6" '
            f'points="{path}"/>'
        )
        size = max(3.0, 8.0 - 1.2 * index) / 2 + 0.5
        if len(values) <= MAX_MARKED:
            parts += [_marker(index, sx(x), sy(y), size, color) for x, y in values]
    legend_top = bottom + BOTTOM
    for row_index, row in enumerate(rows):
        y = legend_top + ROW_H * row_index + 10
        row_width = max(offset for offset, _ in row) + 48 + CHAR_W * len(labels[row[-1][1]])
        start = max(12.0, (WIDTH - row_width) / 2)
        for offset, index in row:
            x = start + offset
            if index < len(colors):
                color, dash = colors[index], ""
            else:
                color, dash = THRESHOLD_COLOR, ' stroke-dasharray="6 4"'
            parts.append(
                f'<line x1="{x:.1f}" y1="{y - 4}" x2="{x + 26:.1f}" y2="{y - 4}" stroke="{color}" '
                f'stroke-width="1.6"{dash}/>'
            )
            if index < len(colors):
                parts.append(_marker(index, x + 13, y - 4, 3.5, color))
            parts.append(f'<text class="legend" x="{x + 32:.1f}" y="{y}">{e(labels[index])}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _marker(index: int, x: float, y: float, r: float, color: str) -> str:
    style = f'fill="white" stroke="{color}" stroke-width="1.3"'
    shape = MARKERS[index % len(MARKERS)]
    if shape == "o":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" {style}/>'
    if shape == "s":
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r:.1f}" height="{2 * r:.1f}" {style}/>'
    corners = {
        "^": [(0, -r), (r, r), (-r, r)],
        "v": [(0, r), (r, -r), (-r, -r)],
        "D": [(0, -r), (r, 0), (0, r), (-r, 0)],
        "P": [(-r, -r / 3), (-r / 3, -r / 3), (-r / 3, -r), (r / 3, -r), (r / 3, -r / 3),
              (r, -r / 3), (r, r / 3), (r / 3, r / 3), (r / 3, r), (-r / 3, r), (-r / 3, r / 3),
              (-r, r / 3)],
    }[shape]  # fmt: skip
    points = " ".join(f"{x + dx:.1f},{y + dy:.1f}" for dx, dy in corners)
    return f'<polygon points="{points}" {style}/>'
