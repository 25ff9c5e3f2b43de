"""Logged metrics as small inline SVG line charts: no plotting library, renders anywhere HTML does.

`MetricSeries` reads `RunState.history` incrementally (only what is new since the last call)
and keeps a bounded number of points per line, so drawing costs the same at step 100 and at
step 100 000.
"""
from __future__ import annotations

import html
import math

MAX_POINTS = 200  # per line; older points are thinned, never the newest
MAX_CHARTS = 8
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


class _Line:
    """One metric of one rank: (step, value) points, every `stride`-th kept once it grows long."""

    def __init__(self):
        self.steps: list[int] = []
        self.values: list[float] = []
        self.stride = 1
        self.count = 0
        self.last: tuple[int, float] | None = None

    def add(self, step: int, value: float) -> None:
        self.last = (step, value)
        self.count += 1
        if (self.count - 1) % self.stride:
            return
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) > 2 * MAX_POINTS:
            self.steps, self.values = self.steps[::2], self.values[::2]
            self.stride *= 2

    def points(self) -> tuple[list[int], list[float]]:
        # The latest point always shows, even when thinning skipped it.
        if self.last is not None and (not self.steps or self.steps[-1] != self.last[0]):
            return self.steps + [self.last[0]], self.values + [self.last[1]]
        return self.steps, self.values


class MetricSeries:
    """Every metric's lines: synced metrics once (rank 0's), the others one line per rank."""

    def __init__(self):
        self.lines: dict[str, dict[int, _Line]] = {}
        self._read = 0

    def consume(self, history: list) -> bool:
        """Take the metrics logged since the last call; True when there were any."""
        new = history[self._read:]
        self._read += len(new)
        for m in new:
            if m.synced and m.rank != 0:
                continue  # the same mean on every rank: draw it once
            self.lines.setdefault(m.name, {}).setdefault(m.rank, _Line()).add(m.step, m.value)
        return bool(new)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def sparkline_svg(name: str, lines: dict[int, _Line], width: int = 220, height: int = 56) -> str:
    """One metric's lines in a small SVG with its name, latest value and range."""
    drawn = {rank: line.points() for rank, line in sorted(lines.items())}
    finite = [v for _, values in drawn.values() for v in values if math.isfinite(v)]
    steps = [x for xs, _ in drawn.values() for x in xs]
    top, pad = 14, 2
    parts = []
    if finite and steps:
        lo, hi = min(finite), max(finite)
        first, last = min(steps), max(steps)
        xspan, yspan = (last - first) or 1, (hi - lo) or 1
        plot_h = height - top - pad
        for rank, (xs, ys) in drawn.items():
            coords = " ".join(
                f"{(x - first) / xspan * (width - 2 * pad) + pad:.1f},{top + (hi - y) / yspan * plot_h:.1f}"
                for x, y in zip(xs, ys) if math.isfinite(y)
            )
            colour = COLOURS[rank % len(COLOURS)]
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}">'
                         f'<title>rank {rank}</title></polyline>')
        latest = lines[min(lines)].last
        label = f"{name} {_fmt(latest[1])}" if latest else name
        parts.append(f'<text x="{width - pad}" y="10" font-size="9" text-anchor="end" fill="#666">'
                     f'{_fmt(lo)} – {_fmt(hi)}</text>')
    else:
        label = name
    parts.insert(0, f'<text x="{pad}" y="10" font-size="10" fill="#333">{html.escape(label)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" style="margin:2px 8px 2px 0">{"".join(parts)}</svg>')


def chart_html(series: MetricSeries) -> str:
    """Every metric's sparkline side by side, with a legend when ranks are drawn separately."""
    names = list(series.lines)[:MAX_CHARTS]
    if not names:
        return ""
    charts = "".join(sparkline_svg(n, series.lines[n]) for n in names)
    ranks = sorted({r for n in names if len(series.lines[n]) > 1 for r in series.lines[n]})
    legend = " ".join(f'<span style="color:{COLOURS[r % len(COLOURS)]}">&#9644; rank {r}</span>' for r in ranks)
    legend = f'<div style="font-size:10px">{legend}</div>' if legend else ""
    return f'<div style="display:flex;flex-wrap:wrap">{charts}</div>{legend}'
