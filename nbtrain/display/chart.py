"""The live chart: every logged metric as a small SVG plot with axes, drawn by hand.

SVG in an ipywidgets HTML widget renders wherever ipywidgets does (JupyterLab, Notebook 7,
VS Code, Colab) with no front-end extension, and a redraw is one string of a few kB: about a
millisecond to build, once a second. It is for the running kernel only; the record a notebook
keeps is the PNG drawn by `figure.py` at the end (untrusted notebooks strip inline SVG).

`MetricSeries` reads `RunState.history` incrementally (only what is new since the last call)
and keeps a bounded number of points per line, so drawing costs the same at step 100 and at
step 100 000.

A steered run's changes (`run.set`, `pause`, `resume`...: `RunState.changes`) are marked where
they were made: a dashed vertical line at the step, labelled with what changed (`change_marks`).
"""
from __future__ import annotations

import html
import math

MAX_POINTS = 200  # per line; older points are thinned, never the newest
MAX_CHARTS = 8
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
WIDTH, HEIGHT = 340, 150
LEFT, RIGHT, TOP, BOTTOM = 46, 10, 20, 20  # margins around the plotting area, px
MEAN = -1  # the "rank" of a synced metric's line: the mean over ranks
MEAN_COLOUR = "#37474f"  # dark grey: not to be read as rank 0's blue in a shared legend
MARK_COLOUR = "#757575"


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
    """Every metric's lines: a synced metric once (the mean, as rank 0 logged it), others per rank."""

    def __init__(self):
        self.lines: dict[str, dict[int, _Line]] = {}
        self._first: dict[str, tuple[bool, int]] = {}
        self._read = 0

    def consume(self, history: list) -> bool:
        """Take the metrics logged since the last call; True when there were any."""
        new = history[self._read:]
        for i, m in enumerate(new, self._read):
            self._first[m.name] = min(self._first.get(m.name, (True, i)), (m.rank != 0, i))
            if m.synced and m.rank != 0:
                continue  # the same mean on every rank: draw it once
            self.lines.setdefault(m.name, {}).setdefault(MEAN if m.synced else m.rank, _Line()).add(m.step, m.value)
        self._read += len(new)
        return bool(new)

    def names(self) -> list[str]:
        """In the order rank 0 logged them (ranks' messages interleave in any order)."""
        return sorted(self.lines, key=self._first.__getitem__)


def change_marks(changes) -> list[tuple[int, str, str]]:
    """(step, label, every change in words) for each step at which the run was changed
    (`protocol.Change`): a set reads as what it set, the others by their kind (`pause`, `call`...)."""
    at: dict[int, list] = {}
    for change in changes:
        at.setdefault(change.step, []).append(change)
    return [(step, " · ".join(dict.fromkeys(c.detail if c.what == "set" else c.what for c in made)),
             "; ".join(f"step {step}: {c.detail}" for c in made)) for step, made in sorted(at.items())]


def line_label(key: int) -> str:
    return "mean over ranks" if key == MEAN else f"rank {key}"


def line_colour(key: int) -> str:
    return MEAN_COLOUR if key == MEAN else COLOURS[key % len(COLOURS)]


def use_log_scale(name: str, values) -> bool:
    """Losses are read on a log scale, when every value is positive."""
    return "loss" in name.lower() and bool(values) and all(v > 0 for v in values)


def fmt(value: float) -> str:
    return f"{value:.4g}"


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About `count` round numbers (1, 2, 5 x 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten within [lo, hi]; 1-2-5 steps when fewer than three decades fit; round
    linear ticks when even those are too few."""
    powers = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    decades = [10.0 ** k for k in powers if lo <= 10.0 ** k <= hi]
    if len(decades) >= 3:
        return decades
    steps = [round(m * 10.0 ** k, 12) for k in powers for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]
    return steps if len(steps) >= 2 else nice_ticks(lo, hi)


class _Axes:
    """Maps data to pixels within a panel (y on a log scale when asked)."""

    def __init__(self, steps: list[int], values: list[float], log: bool):
        # `steps`: the x positions to show (the lines' and the marks')
        self.log = log
        self.x0, self.x1 = min(steps), max(steps)
        lo, hi = min(values), max(values)
        if hi == lo:  # a flat line sits in the middle
            pad = abs(lo) * 0.1 or 1.0
            lo, hi = (lo / 2, hi * 2) if log else (lo - pad, hi + pad)
        self.y0, self.y1 = lo, hi
        self.yticks = log_ticks(lo, hi) if log else nice_ticks(lo, hi)
        self.xticks = [int(t) for t in nice_ticks(self.x0, self.x1) if t == int(t)]

    def x(self, step: float) -> float:
        span = (self.x1 - self.x0) or 1
        return LEFT + (step - self.x0) / span * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        lo, hi, v = self.y0, self.y1, value
        if self.log:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(value)
        return TOP + (hi - v) / ((hi - lo) or 1) * (HEIGHT - TOP - BOTTOM)


def panel_svg(name: str, lines: dict[int, _Line], marks=()) -> str:
    """One metric: axes with round ticks, a line per rank (or the mean), its latest value, and
    the steps at which the run was changed (`change_marks`)."""
    drawn = {key: line.points() for key, line in sorted(lines.items())}
    finite = [v for _, values in drawn.values() for v in values if math.isfinite(v)]
    steps = [x for xs, _ in drawn.values() for x in xs]
    steps += [step for step, _, _ in marks] if steps else []
    log = use_log_scale(name, finite)
    latest = lines[min(lines)].last if lines else None
    title = f"{name} {fmt(latest[1])}" if latest else name
    parts = [f'<text x="{LEFT}" y="13" font-size="12" fill="#222">{html.escape(title)}'
             f'{" (log scale)" if log else ""}</text>']
    if finite and steps:
        axes = _Axes(steps, finite, log)
        bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
        for tick in axes.yticks:
            y = axes.y(tick)
            parts.append(f'<line x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e6e6e6"/>'
                         f'<text x="{LEFT - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end" '
                         f'fill="#555">{fmt(tick)}</text>')
        for tick in axes.xticks:
            x = axes.x(tick)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 3}" stroke="#888"/>'
                         f'<text x="{x:.1f}" y="{bottom + 14}" font-size="10" text-anchor="middle" '
                         f'fill="#555">{tick}</text>')
        parts.append(f'<polyline fill="none" stroke="#888" points="{LEFT},{TOP} {LEFT},{bottom} {right},{bottom}"/>')
        for key, (xs, ys) in drawn.items():
            coords = " ".join(f"{axes.x(x):.1f},{axes.y(y):.1f}" for x, y in zip(xs, ys)
                              if math.isfinite(y) and (y > 0 or not log))
            parts.append(f'<polyline class="nbtrain-line" fill="none" stroke="{line_colour(key)}" stroke-width="1.5" '
                         f'points="{coords}"><title>{line_label(key)}</title></polyline>')
        for i, (step, label, said) in enumerate(marks):
            x = axes.x(step)
            # As the summary figure: near the right edge the label reads leftward, neighbours on two lines.
            left = x - LEFT > 0.7 * (right - LEFT)
            at = (f'x="{x - 2:.1f}" text-anchor="end"' if left else f'x="{x + 2:.1f}"')
            at += f' y="{TOP + 9 + 10 * (i % 2)}"'
            parts.append(f'<g class="nbtrain-change"><title>{html.escape(said)}</title>'
                         f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{bottom}" stroke="{MARK_COLOUR}" '
                         f'stroke-dasharray="3,2"/><text {at} font-size="9" '
                         f'fill="{MARK_COLOUR}">{html.escape(label)}</text></g>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" style="margin:2px 12px 2px 0">{"".join(parts)}</svg>')


def legend_html(series: MetricSeries, names: list[str]) -> str:
    keys = sorted({key for n in names for key in series.lines[n]})
    # The lines are named even when there is one: a mean over ranks is not rank 0's curve.
    shown = [] if keys == [0] else keys
    items = " ".join(f'<span style="color:{line_colour(k)}">&#9644; {line_label(k)}</span>' for k in shown)
    return f'<div style="font-size:11px">{items} <span style="color:#777">(x axis: step)</span></div>'


def chart_html(series: MetricSeries, changes=()) -> str:
    """Every metric's plot side by side (up to MAX_CHARTS), with a legend for the lines, and
    `changes` (`protocol.Change`) marked on each."""
    names = series.names()[:MAX_CHARTS]
    if not names:
        return ""
    marks = change_marks(changes)
    charts = "".join(panel_svg(n, series.lines[n], marks) for n in names)
    return f'<div class="nbtrain-chart" style="display:flex;flex-wrap:wrap">{charts}</div>{legend_html(series, names)}'
