"""The live dashboard in Jupyter, and the static record that replaces it when the run ends.

During a run: a row per rank (status, a bar per progress level, step rate with the slowest
rank marked, memory, latest metrics), then a chart of every logged metric. Like
tqdm.notebook this only draws: RunState counts. Drawing happens at most ~10 times a second
and only when the state changed, so a fast loop never waits on the front end.

When the run ends (finished, failed or interrupted) both outputs are replaced in place
(IPython display ids) by a static summary: an HTML table with a text/plain twin, and the
metrics as a PNG from matplotlib. Then every widget is closed. A saved notebook thus holds no
widget models of finished runs, and reads the same after reopening, untrusted, on nbviewer
and on GitHub.

After a run, `nbtrain.display.widgets.last_dashboard` is the dashboard that drew it.
"""
from __future__ import annotations

import base64
import html
import logging
import sys
import time

from .chart import MetricSeries, chart_html
from .figure import MISSING_MATPLOTLIB, have_matplotlib, metrics_figure, metrics_text, png
from .text import QuietDisplay, batch_text, fraction_text, metric_values_text, summary_lines
from .vitals import latest, memory_text, rate_text, slowest

log = logging.getLogger(__name__)

REDRAW_INTERVAL = 0.1  # seconds: at most 10 redraws a second,
DRAW_BUDGET = 0.005  # and about this share of the kernel's time spent drawing: with many ranks
MAX_INTERVAL = 0.5  # (more widgets, more messages) or a busy machine it redraws less often
CLOCK_INTERVAL = 1.0  # elapsed time ticks even when nothing else changes
CHART_INTERVAL = 1.0  # the chart is the largest message: send it less often

MISSING_IPYWIDGETS = ("ipywidgets is not installed, so progress is shown as text. For the live dashboard "
                      "and pick_gpus(): pip install 'ipywidgets>=8', then restart the kernel.")
NEUTRAL = "#757575"
STATUS_COLOURS = {"starting": NEUTRAL, "running": "#1565c0", "finished": "#2e7d32", "failed": "#c62828",
                  "stopped": NEUTRAL, "interrupted": NEUTRAL}
# (bar_style, bar_color): a stopped rank's bar goes grey, not amber: it did nothing wrong.
BAR_STYLES = {"failed": ("danger", None), "stopped": ("", "#9e9e9e"), "finished": ("success", None)}
STRAGGLER_MARK = '<b style="color:#ef6c00" title="the slowest rank">slowest</b>'

last_dashboard: WidgetDisplay | None = None

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


def show(bundle: dict, display_id: bool = False):
    """Display a MIME bundle in the running cell (a handle to replace it with `update` when
    `display_id`); outside IPython print its text."""
    if ipython_shell() is None:
        print(bundle.get("text/plain", ""), flush=True)
        return None
    from IPython.display import display

    return display(bundle, raw=True, display_id=True) if display_id else display(bundle, raw=True)


def show_again(handle, bundle: dict) -> None:
    """Show `bundle` anew as one more output of `handle`'s display id (its updates reach both)."""
    if handle is not None:
        from IPython.display import display

        display(bundle, raw=True, display_id=handle.display_id)


def replace(handle, bundle: dict) -> None:
    """Put `bundle` where `handle`'s output is; show it anew when there is no such output."""
    if handle is None:
        show(bundle)
    else:
        handle.update(bundle, raw=True)


def view_bundle(widget) -> dict:
    """What shows `widget` in a cell: its `_repr_mimebundle_` without the text twin, whose repr of
    the whole widget tree (~1.5 ms for a 2-rank dashboard) the caller replaces anyway."""
    return {"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                        "model_id": widget.model_id}}


def close_tree(*widgets) -> None:
    """Close widgets with their children, layouts and styles: each is a model in the front end."""
    for widget in widgets:
        close_tree(*getattr(widget, "children", ()))
        for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
            if part is not None:
                part.close()
        widget.close()


def duration_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _bar_info(bar, rate: float | None) -> str:
    """n/total, and for the innermost loop the time left at the rank's step rate."""
    parts = [fraction_text(bar.n, bar.total)]
    if rate and bar.total is not None and not bar.done:
        parts.append(f"eta {duration_text((bar.total - bar.n) / rate)}")
    return "  ".join(parts)


def detail_html(status: str, detail: str, reason: str) -> str:
    """A failed rank's first line in red; a stopped rank's "stopped (rank N failed)" in grey, its own
    message (often a peer's disconnect, not the cause) folded underneath."""
    colour = STATUS_COLOURS["failed"] if status == "failed" else NEUTRAL
    text = f'<span style="color:{colour}">{html.escape(detail)}</span>' if detail else ""
    if reason:
        text += (f'<details style="color:{NEUTRAL}"><summary>its own message</summary>'
                 f'<pre style="white-space:pre-wrap;margin:0">{html.escape(reason)}</pre></details>')
    return text


class _Parts:
    """The widgets of one dashboard, made with layouts and styles shared where no widget changes
    its own: each Layout and style is a model of its own in the front end (a message to open,
    one to close, ~0.3 ms of the kernel's each), and a dashboard made them per widget: 96
    models for 2 ranks, a quarter of a short launch."""

    def __init__(self, w):
        self.w = w
        self._layouts: dict[tuple, object] = {}
        from ipywidgets.widgets.widget_string import HTMLStyle, LabelStyle  # not exported at the top

        self.label_style, self.html_style = LabelStyle(), HTMLStyle()

    def layout(self, **spec):
        """A Layout shared by every widget laid out alike (never changed after it is made)."""
        key = tuple(sorted(spec.items()))
        made = self._layouts.get(key)
        if made is None:
            made = self._layouts[key] = self.w.Layout(**spec)
        return made

    def label(self, text: str = "", **layout):
        return self.w.Label(text, layout=self.layout(**layout), style=self.label_style)

    def html(self, value: str = "", **layout):
        return self.w.HTML(value, layout=self.layout(**layout), style=self.html_style)

    def box(self, kind, children=()):
        return kind(list(children), layout=self.layout())

    def shared(self) -> list:
        return [*self._layouts.values(), self.label_style, self.html_style]


class _BarRow:
    # Each draw compares with what was last sent before touching a trait: a trait set costs
    # ~10 µs even when unchanged, and a changed one a comm message (~80 µs in a kernel).
    def __init__(self, parts: _Parts, desc: str):
        w = parts.w
        self.label = parts.label(desc, width="5em")
        self.progress = w.IntProgress(value=0, min=0, max=1, layout=parts.layout(width="14em"))  # its own style
        self.info = parts.label(width="10em")
        self.box = parts.box(w.HBox, [self.label, self.progress, self.info])
        self._shown: tuple = ()

    def draw(self, bar, status: str, rate: float | None) -> None:
        total = bar.total if bar.total else max(bar.n, 1)
        style, colour = BAR_STYLES.get(status, ("", None))
        shown = (total, min(bar.n, total), style, colour, bar.desc, _bar_info(bar, rate))
        if shown == self._shown:
            return
        if shown[:4] != self._shown[:4]:
            with self.progress.hold_sync():
                self.progress.max = total  # before value: value is clamped to [min, max]
                self.progress.value = shown[1]
                self.progress.bar_style = style
                self.progress.style.bar_color = colour
        self.label.value, self.info.value = shown[4:]
        self._shown = shown


def _head_html(rank: int, status: str) -> str:
    """A rank's row starts with its number and its status, coloured."""
    return (f'<span style="display:inline-block;width:4.5em">rank {rank}</span>'
            f'<span style="color:{STATUS_COLOURS.get(status, NEUTRAL)}">{html.escape(status)}</span>')


class _RankRow:
    def __init__(self, parts: _Parts, rank: int):
        w = parts.w
        self._parts = parts
        self.rank = rank
        # Text beside the bars is one HTML widget each side (the rank and its status; its vitals
        # and metrics): fewer models, and one message when both halves change.
        self.status, self.vitals, self.metrics = "starting", "", ""
        self.head = parts.html(_head_html(rank, self.status), width="10em")
        # Made when the rank first reports a loop: a run without one (a short job, an
        # evaluation) makes none, and a bar costs ~5 models.
        self.bars: dict[int, _BarRow] = {}
        self.bar_box = parts.box(w.VBox)
        self.info = parts.html(margin="0 0 0 1em")
        self.detail = w.HTML(layout=w.Layout(display="none", margin="0 0 0 4.5em"), style=parts.html_style)
        self.box = parts.box(w.VBox, [parts.box(w.HBox, [self.head, self.bar_box, self.info]), self.detail])
        self.box.add_class("nbtrain-rank")  # a handle for styling and for the browser tests
        self._drawn: tuple = ()
        self._levels: list[int] = []

    def draw(self, view, state, final: bool, vital, straggler: bool) -> bool:
        """Show `view`; True when widgets had to be created (a one-off cost)."""
        status, detail, reason = state.outcome(view.rank, final)
        if self.status != status:
            self.status = status
            self.head.value = _head_html(self.rank, status)
        built = not view.bars.keys() <= self.bars.keys()
        for level, bar in view.bars.items():
            if level not in self.bars:
                self.bars[level] = _BarRow(self._parts, bar.desc)
        levels = sorted(view.bars)
        if levels != self._levels:  # a new level, or a deeper one ended; its widgets are kept for reuse
            self._levels = levels
            self.bar_box.children = [self.bars[lv].box for lv in levels]
        rate = view.step_rate if final else (vital.step_rate if vital else None)
        for level, bar in view.bars.items():
            self.bars[level].draw(bar, status, rate if level == view.step_level else None)
        drawn = (tuple(view.metrics.values()), vital, straggler, detail, reason, rate, view.steps > 0)
        if drawn != self._drawn:
            metrics = (self._drawn or (None,))[0]
            self._drawn = drawn
            if drawn[0] != metrics:
                text = html.escape(metric_values_text(view.metrics))
                self.metrics = f"<code>{text}</code>" if text else ""
            parts = [rate_text(rate, None if final else view), html.escape(memory_text(vital)),
                     STRAGGLER_MARK if straggler else ""]
            self.vitals = " · ".join(p for p in parts if p)
            both = (f'<span style="display:inline-block;width:15em">{self.vitals}</span>'
                    f'<span style="margin-left:1em">{self.metrics}</span>')
            self.info.value = both if self.vitals or self.metrics else ""
            self.detail.value = detail_html(status, detail, reason)
            self.detail.layout.display = "" if detail or reason else "none"
        return built

    def widgets(self) -> list:
        return [self.box, *(bar.box for bar in self.bars.values())]

    def snapshot(self) -> dict:
        return {
            "status": self.status,
            "bars": {lv: {"desc": b.label.value, "value": b.progress.value, "max": b.progress.max,
                          "bar_style": b.progress.bar_style, "bar_color": b.progress.style.bar_color,
                          "info": b.info.value}
                     for lv, b in sorted(self.bars.items()) if lv in self._levels},
            "vitals": self.vitals,
            "metrics": self.metrics,
            "detail": self.detail.value,
        }


class WidgetDisplay(QuietDisplay):
    """ipywidgets dashboard; rank output is printed to the cell (tagged, stderr kept as stderr)."""

    def __init__(self):
        super().__init__()
        self._parts = parts = _Parts(w := load_ipywidgets())
        self.rows: dict[int, _RankRow] = {}
        self.series = MetricSeries()
        self.changes: list = []  # a steered run's, marked on the chart
        self.header = parts.html()
        self.rows_box = parts.box(w.VBox)
        self.root = parts.box(w.VBox, [self.header, self.rows_box])
        self.root.add_class("nbtrain-dashboard")
        self.chart = w.HTML(layout=w.Layout(display="none"), style=parts.html_style)  # shown with the first metric
        self.ok: bool | None = None  # None while running
        self.summary = ""  # the static HTML left at the end
        self.plot_png: bytes | None = None  # and the metrics' picture, when matplotlib is there
        self._handles = (None, None)
        self._bundles = ({}, {})
        self._seen = -1
        self._drawn = self._clock = self._charted = 0.0
        self._interval = REDRAW_INTERVAL
        self._cost = 0.0  # seconds per redraw, smoothed
        self._chart_stale = False

    # -- the display interface -----------------------------------------------------------
    def start(self, state) -> None:
        global last_dashboard
        if self.ok is not None:  # started again after a run ended: fresh widgets for the new run
            self.__init__()  # type: ignore[misc]  # this class's own fields, fresh
        last_dashboard = self
        self.rank_output.start(state)
        self._draw(state, time.monotonic())
        dashboard = {**view_bundle(self.root),
                     "text/plain": f"nbtrain: {state.title} (live; replaced by a summary when the run ends)"}
        chart = {**view_bundle(self.chart), "text/plain": ""}
        self._bundles = (dashboard, chart)
        self._handles = (show(dashboard, display_id=True), show(chart, display_id=True))

    def update(self, state) -> None:
        self.vitals.maybe_sample(state)
        self.rank_output.tick()  # the ranks' tabs (Jupyter)
        now = time.monotonic()
        if now - self._drawn < self._interval or self.ok is not None:  # after finish: nothing live to draw
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
        self._draw(state, time.monotonic(), force_chart=True)  # the widgets' last state, for snapshot()
        self.summary = summary_html(state, ok)
        table = {"text/html": self.summary, "text/plain": "\n".join(summary_lines(state, ok))}
        plot = plot_bundle(state.history, state.changes)
        self.plot_png = base64.b64decode(plot["image/png"]) if "image/png" in plot else None
        # Replace first, close after: a closed widget still on screen reads "model not found".
        replace(self._handles[0], table)
        replace(self._handles[1], plot)
        close_tree(self.root, self.chart, *(w for row in self.rows.values() for w in row.widgets()),
                   *self._parts.shared())
        self._end_rank_output()

    def _shown_again(self) -> None:
        """A rank cleared the cell's output: the dashboard comes back, under the same display ids
        (so the summary still replaces it at the end)."""
        if self.ok is None:
            for handle, bundle in zip(self._handles, self._bundles):
                show_again(handle, bundle)

    # -- drawing -------------------------------------------------------------------------
    def _draw(self, state, now: float, force_chart: bool = False) -> None:
        started = time.perf_counter()
        self._seen, self._drawn, self._clock = state.version, now, now
        final = self.ok is not None
        vitals = latest(state)
        rates = {r: (v.step_rate if final else (vitals[r].step_rate if r in vitals else None))
                 for r, v in state.ranks.items()}
        straggler = slowest(rates)
        built = not state.ranks.keys() <= self.rows.keys()
        for rank in state.ranks.keys() - self.rows.keys():
            self.rows[rank] = _RankRow(self._parts, rank)
        if built:  # one message for the new rows, not one a row
            self.rows_box.children = [r.box for _, r in sorted(self.rows.items())]
        for rank, view in state.ranks.items():
            built |= self.rows[rank].draw(view, state, final, vitals.get(rank), rank == straggler)
        self._draw_header(state)
        self._chart_stale |= self.series.consume(state.history) | (len(state.changes) != len(self.changes))
        self.changes = list(state.changes)
        if not built:  # creating widgets is a one-off: it must not slow the redraws after it
            cost = time.perf_counter() - started
            self._cost = cost if not self._cost else (self._cost + cost) / 2
            self._interval = min(MAX_INTERVAL, max(REDRAW_INTERVAL, self._cost / DRAW_BUDGET))
        if self._chart_stale and (force_chart or now - self._charted >= CHART_INTERVAL):
            self._draw_chart(now)

    def _draw_chart(self, now: float) -> None:
        self.chart.value = chart_html(self.series, self.changes)
        self.chart.layout.display = ""
        self._charted, self._drawn, self._chart_stale = now, now, False

    def _draw_header(self, state) -> None:
        word = "running" if self.ok is None else state.verdict(self.ok)
        parts = [f"<b>nbtrain</b> {html.escape(state.title)}",
                 f'<span style="color:{STATUS_COLOURS[word]}">{word}</span>', f"{duration_text(state.elapsed)} elapsed",
                 batch_text(state, "×")]
        stalled = (f'<br><span style="color:{STATUS_COLOURS["failed"]}">stalled: {html.escape(state.stall)}</span>'
                   if state.stall and self.ok is None else "")  # the doctor's verdict, while it holds
        self.header.value = " · ".join(p for p in parts if p) + stalled

    def snapshot(self) -> dict:
        """What the widgets show now, as plain data (for tests and for a look after a run)."""
        return {"header": self.header.value, "ok": self.ok,
                "ranks": {rank: row.snapshot() for rank, row in sorted(self.rows.items())},
                "chart": self.chart.value, "closed": self.root.comm is None and self.chart.comm is None}


def summary_html(state, ok: bool) -> str:
    """The run's end state as a static HTML table: how it ended, and each rank's progress,
    step rate (the slowest marked), memory, metrics and failure or stop reason."""
    word = state.verdict(ok)
    head = (f'<b>nbtrain</b> {html.escape(state.title)}: <span style="color:{STATUS_COLOURS[word]}">'
            f"{word}</span> in {state.elapsed:.2f} s")
    batch = batch_text(state, "×")
    head += f"; {batch}" if batch else ""
    vitals = latest(state)
    straggler = slowest({r: v.step_rate for r, v in state.ranks.items()})
    cells = ["rank", "status", "progress", "steps/s", "memory", "metrics", ""]
    rows = ["<tr>" + "".join(f"<th style='text-align:left'>{c}</th>" for c in cells) + "</tr>"]
    for rank, view in sorted(state.ranks.items()):
        status, detail, reason = state.outcome(rank, final=True)
        label = detail if detail.startswith(status) else status  # "stopped (rank 1 failed)"
        why = detail_html(status, "" if label == detail else detail, reason)
        progress = ", ".join(f"{b.desc} {fraction_text(b.n, b.total)}" for _, b in sorted(view.bars.items()))
        rate = rate_text(view.step_rate) + (f" {STRAGGLER_MARK}" if rank == straggler else "")
        values = [str(rank), f'<span style="color:{STATUS_COLOURS.get(status, "")}">{html.escape(label)}</span>',
                  html.escape(progress), rate, html.escape(memory_text(vitals.get(rank))),
                  html.escape(metric_values_text(view.metrics)), why]
        rows.append("<tr>" + "".join(f"<td style='text-align:left'>{v}</td>" for v in values) + "</tr>")
    doctor = "".join(f"<div>{html.escape(line)}</div>" for line in state.doctor_lines())
    return f'<div class="nbtrain-summary"><div>{head}</div><table>{"".join(rows)}</table>{doctor}</div>'


def plot_bundle(history, changes=()) -> dict:
    """The logged metrics as a PNG with a text twin; text only without metrics or matplotlib."""
    if not history:
        return {"text/plain": ""}
    text = metrics_text(history)
    if not have_matplotlib():
        return {"text/plain": f"{text}\n({MISSING_MATPLOTLIB})"}
    try:
        picture = png(metrics_figure(history, changes=changes))
    except Exception as exc:  # a picture must never hide how the run ended
        log.warning("could not draw the metrics: %s", exc)
        return {"text/plain": text}
    return {"image/png": base64.b64encode(picture).decode("ascii"), "text/plain": text}
