"""The live dashboard in Jupyter: a row per rank (status, a bar per progress level, metrics),
a chart of the logged metrics, elapsed time and effective batch size.

Like tqdm.notebook, this only draws: RunState counts. Drawing happens at most ~10 times a
second and only when the state changed, so a fast loop never waits on the front end. When
the run ends the widgets keep their final state, and a static HTML summary follows for
renderers without widgets (GitHub, nbviewer, nbconvert).

After a run, `nbtrain.display.widgets.last_dashboard` is the dashboard that drew it.
"""
from __future__ import annotations

import html
import logging
import sys
import time

from .chart import MetricSeries, chart_html
from .text import QuietDisplay, _fraction, _metric_text, summary_lines

log = logging.getLogger(__name__)

REDRAW_INTERVAL = 0.1  # seconds: at most 10 redraws a second,
DRAW_BUDGET = 0.005  # and about this share of the kernel's time spent drawing: with many ranks
MAX_INTERVAL = 0.5  # (more widgets, more messages) or a busy machine it redraws less often
CLOCK_INTERVAL = 1.0  # elapsed time ticks even when nothing else changes
CHART_INTERVAL = 1.0  # the chart is the largest message: send it less often
PREBUILT_LEVELS = 2  # progress bars made per rank at start (epoch, batch)

MISSING_IPYWIDGETS = ("ipywidgets is not installed, so progress is shown as text. For the live dashboard "
                      "and pick_gpus(): pip install 'ipywidgets>=8', then restart the kernel.")
STATUS_COLOURS = {"starting": "#757575", "running": "#1565c0", "finished": "#2e7d32",
                  "failed": "#c62828", "stopped": "#ef6c00"}
BAR_STYLES = {"failed": "danger", "stopped": "warning", "finished": "success"}

last_dashboard: "WidgetDisplay | None" = None

_front_end_ready = False


def load_ipywidgets():
    """ipywidgets, with the front end made ready for it; ImportError saying the fix if missing.

    Colab renders ipywidgets 8 only through its custom widget manager, switched on once.
    """
    global _front_end_ready
    try:
        import ipywidgets
    except ImportError as exc:
        raise ImportError(MISSING_IPYWIDGETS) from exc
    if not _front_end_ready:
        _front_end_ready = True
        if "google.colab" in sys.modules:
            try:
                from google.colab import output

                output.enable_custom_widget_manager()
            except Exception as exc:  # an older Colab: widgets may still render
                log.debug("could not enable Colab's custom widget manager: %s", exc)
    return ipywidgets


def ipython_shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def show(bundle: dict) -> None:
    """Display a MIME bundle in the running cell; outside IPython print its text."""
    if ipython_shell() is None:
        print(bundle.get("text/plain", ""), flush=True)
        return
    from IPython.display import display

    display(bundle, raw=True)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _bar_info(bar) -> str:
    parts = [_fraction(bar.n, bar.total)]
    if bar.rate:
        parts.append(f"{bar.rate:.3g} it/s")
    if bar.eta is not None and not bar.done:
        parts.append(f"eta {_duration(bar.eta)}")
    return "  ".join(parts)


def _status(view, final: bool) -> str:
    # Ranks still "running" when a failed or interrupted run ended were stopped by nbtrain.
    return "stopped" if final and view.status in ("starting", "running") else view.status


def _batch_text(state) -> str:
    if not state.effective_batch_size:
        return ""
    per, n = state.per_rank_batch_size, len(state.ranks)
    split = f" ({per} per rank × {state.effective_batch_size // per} ranks)" if n > 1 and per else ""
    return f"effective batch size {state.effective_batch_size}{split}"


class _BarRow:
    # Each draw compares with what was last sent before touching a trait: a trait set costs
    # ~10 µs even when unchanged, and a changed one a comm message (~80 µs in a kernel).
    def __init__(self, w, desc: str):
        self.label = w.Label(desc, layout=w.Layout(width="5em"))
        self.progress = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="16em"))
        self.info = w.Label(layout=w.Layout(width="16em"))
        self.box = w.HBox([self.label, self.progress, self.info])
        self._shown: tuple = ()

    def draw(self, bar, style: str) -> None:
        total = bar.total if bar.total else max(bar.n, 1)
        shown = (total, min(bar.n, total), style, bar.desc, _bar_info(bar))
        if shown == self._shown:
            return
        if shown[:3] != self._shown[:3]:
            with self.progress.hold_sync():
                self.progress.max = total  # before value: value is clamped to [min, max]
                self.progress.value = shown[1]
                self.progress.bar_style = style
        self.label.value, self.info.value = shown[3:]
        self._shown = shown


class _RankRow:
    def __init__(self, w, rank: int):
        self._w = w
        self.rank = rank
        self.status = w.Label("starting", layout=w.Layout(width="5.5em"))
        # Built before the ranks start, shown when used: creating widgets costs ~5 ms each
        # bar, better spent now than while the ranks train. Most loops nest two levels.
        self.bars: dict[int, _BarRow] = {level: _BarRow(w, "") for level in range(PREBUILT_LEVELS)}
        self.bar_box = w.VBox()
        self.metrics = w.HTML(layout=w.Layout(margin="0 0 0 1em"))
        self.detail = w.HTML(layout=w.Layout(display="none"))
        head = w.Label(f"rank {rank}", layout=w.Layout(width="4.5em"))
        self.box = w.VBox([w.HBox([head, self.status, self.bar_box, self.metrics]), self.detail])
        self._metrics: tuple = ()
        self._levels: list[int] = []

    def draw(self, view, final: bool) -> bool:
        """Show `view`; True when widgets had to be created (a one-off cost)."""
        status = _status(view, final)
        if self.status.value != status:
            self.status.value = status
            self.status.style.text_color = STATUS_COLOURS.get(status, "")
        built = not view.bars.keys() <= self.bars.keys()
        for level, bar in view.bars.items():
            if level not in self.bars:
                self.bars[level] = _BarRow(self._w, bar.desc)
        levels = sorted(view.bars)
        if levels != self._levels:  # a new level, or a deeper one ended; its widgets are kept for reuse
            self._levels = levels
            self.bar_box.children = [self.bars[lv].box for lv in levels]
        style = BAR_STYLES.get(status, "")
        for level, bar in view.bars.items():
            self.bars[level].draw(bar, style)
        metrics = tuple(view.metrics.values())
        if metrics != self._metrics:
            self._metrics = metrics
            text = html.escape(_metric_text(view.metrics))
            self.metrics.value = f"<code>{text}</code>" if text else ""
        if view.detail and self.detail.layout.display == "none":
            colour = STATUS_COLOURS["failed"]
            self.detail.value = f'<span style="color:{colour}">{html.escape(view.detail)}</span>'
            self.detail.layout.display = ""
        return built

    def snapshot(self) -> dict:
        return {
            "status": self.status.value,
            "bars": {lv: {"desc": b.label.value, "value": b.progress.value, "max": b.progress.max,
                          "bar_style": b.progress.bar_style} for lv, b in sorted(self.bars.items()) if lv in self._levels},
            "metrics": self.metrics.value,
            "detail": self.detail.value,
        }


class WidgetDisplay(QuietDisplay):
    """ipywidgets dashboard; rank output is printed to the cell (tagged, stderr kept as stderr)."""

    def __init__(self):
        super().__init__()
        self._w = load_ipywidgets()
        self.rows: dict[int, _RankRow] = {}
        self.series = MetricSeries()
        self.header = self._w.HTML()
        self.chart = self._w.HTML()
        self.rows_box = self._w.VBox()
        self.root = self._w.VBox([self.header, self.rows_box, self.chart])
        self.ok: bool | None = None  # None while running
        self.summary = ""  # the static HTML emitted at the end
        self._seen = -1
        self._drawn = self._clock = self._charted = 0.0
        self._interval = REDRAW_INTERVAL
        self._cost = 0.0  # seconds per redraw, smoothed
        self._chart_stale = False

    # -- the display interface -----------------------------------------------------------
    def start(self, state) -> None:
        global last_dashboard
        last_dashboard = self
        self._draw(state, time.monotonic())
        bundle = self.root._repr_mimebundle_()
        bundle["text/plain"] = f"nbtrain: {state.title} (live widget; a summary follows when the run ends)"
        show(bundle)

    def update(self, state) -> None:
        now = time.monotonic()
        if now - self._drawn < self._interval:
            return
        if state.version != self._seen:
            self._draw(state, now)
        elif self._chart_stale and now - self._charted >= CHART_INTERVAL:
            self._draw_chart(now)
        elif now - self._clock >= CLOCK_INTERVAL:
            self._clock = self._drawn = now
            self._draw_header(state)

    def finish(self, state, ok: bool) -> None:
        self.ok = ok
        self._draw(state, time.monotonic(), force_chart=True)
        self.summary = summary_html(state, ok, self.series)
        show({"text/html": self.summary, "text/plain": "\n".join(summary_lines(state, ok))})

    # -- drawing -------------------------------------------------------------------------
    def _draw(self, state, now: float, force_chart: bool = False) -> None:
        started = time.perf_counter()
        self._seen, self._drawn, self._clock = state.version, now, now
        final = self.ok is not None
        built = False
        for rank, view in state.ranks.items():
            row = self.rows.get(rank)
            if row is None:
                row = self.rows[rank] = _RankRow(self._w, rank)
                self.rows_box.children = [r.box for _, r in sorted(self.rows.items())]
                built = True
            built |= row.draw(view, final)
        self._draw_header(state)
        self._chart_stale |= self.series.consume(state.history)
        if not built:  # creating widgets is a one-off: it must not slow the redraws after it
            cost = time.perf_counter() - started
            self._cost = cost if not self._cost else (self._cost + cost) / 2
            self._interval = min(MAX_INTERVAL, max(REDRAW_INTERVAL, self._cost / DRAW_BUDGET))
        if self._chart_stale and (force_chart or now - self._charted >= CHART_INTERVAL):
            self._draw_chart(now)

    def _draw_chart(self, now: float) -> None:
        self.chart.value = chart_html(self.series)
        self._charted, self._drawn, self._chart_stale = now, now, False

    def _draw_header(self, state) -> None:
        verdict = "running" if self.ok is None else _verdict(state, self.ok)
        colour = STATUS_COLOURS[verdict]
        parts = [f"<b>nbtrain</b> {html.escape(state.title)}",
                 f'<span style="color:{colour}">{verdict}</span>', f"{_duration(state.elapsed)} elapsed",
                 _batch_text(state)]
        self.header.value = " · ".join(p for p in parts if p)

    def snapshot(self) -> dict:
        """What the widgets show now, as plain data (for tests and for a look after a run)."""
        return {"header": self.header.value, "ok": self.ok,
                "ranks": {rank: row.snapshot() for rank, row in sorted(self.rows.items())},
                "chart": self.chart.value}


def _verdict(state, ok: bool) -> str:
    # Not ok without a failure: interrupted (Ctrl-C), and the ranks were stopped.
    return "finished" if ok else ("failed" if state.failures else "stopped")


def summary_html(state, ok: bool, series: MetricSeries | None = None) -> str:
    """The run's end state as static HTML: reads where widgets do not render."""
    verdict = _verdict(state, ok)
    head = (f'<b>nbtrain</b> {html.escape(state.title)}: <span style="color:{STATUS_COLOURS[verdict]}">'
            f"{verdict}</span> in {state.elapsed:.2f} s")
    batch = _batch_text(state)
    head += f"; {batch}" if batch else ""
    cells = ["rank", "status", "progress", "rate", "metrics", ""]
    rows = ["<tr>" + "".join(f"<th style='text-align:left'>{c}</th>" for c in cells) + "</tr>"]
    for rank, view in sorted(state.ranks.items()):
        status = _status(view, final=True)
        levels = [b for _, b in sorted(view.bars.items())]
        progress = ", ".join(f"{b.desc} {_fraction(b.n, b.total)}" for b in levels)
        rate = f"{levels[-1].rate:.3g} it/s" if levels and levels[-1].rate else ""
        values = [str(rank), f'<span style="color:{STATUS_COLOURS.get(status, "")}">{status}</span>',
                  html.escape(progress), rate, html.escape(_metric_text(view.metrics)), html.escape(view.detail)]
        rows.append("<tr>" + "".join(f"<td style='text-align:left'>{v}</td>" for v in values) + "</tr>")
    if series is None:
        series = MetricSeries()
        series.consume(state.history)
    return f'<div class="nbtrain-summary"><div>{head}</div><table>{"".join(rows)}</table>{chart_html(series)}</div>'
