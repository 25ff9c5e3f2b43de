"""What a sweep shows: a row per trial (its parameters, state, latest metric, slot) and the best
so far, live; a static summary when it ends.

In Jupyter the live table is one HTML output replaced in place (a display id), with the trials'
curves overlaid beneath it; at the end it is replaced by the summary (an HTML table with a
text/plain twin) and the curves as a PNG, as a launch's dashboard is. No widget is made, so a
saved notebook holds nothing that needs the kernel. Elsewhere (a terminal, a log) each trial's
start and end is one line. The sweep decides everything (Optuna says what is best); this module
only draws `SweepState`.
"""
from __future__ import annotations

import base64
import html
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

from . import check_progress, in_jupyter
from .chart import _Line, panel_svg, use_log_scale
from .figure import have_matplotlib, png
from .widgets import duration_text, replace, show

log = logging.getLogger(__name__)

REDRAW_INTERVAL = 0.5  # seconds between redraws of the live table, at most
STATE_COLOURS = {"running": "#1565c0", "complete": "#2e7d32", "pruned": "#757575", "failed": "#c62828",
                 "interrupted": "#757575", "waiting": "#757575"}
MAX_ROWS = 200  # live: the latest trials beyond this are shown, the rest counted
BEST_COLOUR = "#1565c0"


@dataclass
class TrialRow:
    number: int
    params: dict
    slot: str
    state: str = "running"  # running, complete, pruned, failed, interrupted
    value: float | None = None  # the metric's latest value; once complete, the trial's value
    step: int | None = None
    progress: str = ""  # rank 0's innermost loop, "epoch 3/10"
    detail: str = ""  # a failure's first line, "pruned at step 3"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    curve: _Line = field(default_factory=_Line)

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started


@dataclass
class SweepState:
    title: str  # "sweep of train"
    metric: str
    direction: str
    slots: str  # "2 CPU slots"
    target: int  # trials the study should hold when the sweep ends
    earlier: int = 0  # trials the study held when this call began
    rows: dict[int, TrialRow] = field(default_factory=dict)
    best: tuple[int, float, dict] | None = None  # (number, value, params), as Optuna says
    importances: dict[str, float] | None = None  # Optuna's parameter importances, once the sweep ended
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    version: int = 0

    def add(self, row: TrialRow) -> None:
        """A new trial's row. The dict is replaced, not changed: a view reading the old one, on
        another thread, is not disturbed."""
        self.rows = {**self.rows, row.number: row}
        self.version += 1

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.rows.values():
            counts[row.state] = counts.get(row.state, 0) + 1
        return counts

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


def number(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={number(v)}" for k, v in params.items())


def best_text(state: SweepState) -> str:
    if state.best is None:
        return "no trial complete yet"
    trial, value, params = state.best
    return f"best: trial {trial}, {state.metric}={number(value)} ({params_text(params)})"


def headline(state: SweepState, verdict: str | None = None) -> str:
    counts = state.counts()
    done = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    earlier = f"; {state.earlier} earlier" if state.earlier else ""
    when = f"{verdict} in {state.elapsed:.1f} s" if verdict else f"{duration_text(state.elapsed)} elapsed"
    return (f"nbtrain {state.title} on {state.slots}: {when}; {len(state.rows)} trials here ({done or 'none'})"
            f"{earlier} of {state.target}; {best_text(state)}")


def row_line(row: TrialRow, metric: str) -> str:
    at = f" @ step {row.step}" if row.step is not None else ""
    value = "" if row.value is None else f"{metric}={number(row.value)}{at}"
    parts = [f"trial {row.number}", row.state, params_text(row.params), value, row.progress, f"[{row.slot}]",
             f"{row.seconds:.1f} s" if row.ended else "", row.detail]
    return "  ".join(p for p in parts if p)


def _rows_html(state: SweepState, final: bool) -> str:
    names = list(dict.fromkeys(k for row in state.rows.values() for k in row.params))
    # "at step": the step the value was logged at (ctx.log's, from 0), beside the loop's count (3/3).
    head = ["trial", "state", *names, state.metric, "at step", "progress", "slot", "time", ""]
    best = state.best[0] if state.best else None
    rows = sorted(state.rows.values(), key=lambda r: r.number)
    hidden = max(0, len(rows) - MAX_ROWS) if not final else 0
    cells = ["<tr>" + "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows[hidden:]:
        colour = STATE_COLOURS.get(row.state, "")
        values = [str(row.number), f'<span style="color:{colour}">{html.escape(row.state)}</span>',
                  *(html.escape(number(row.params[n])) if n in row.params else "" for n in names),
                  "" if row.value is None else number(row.value), "" if row.step is None else str(row.step),
                  html.escape(row.progress), html.escape(row.slot), f"{row.seconds:.1f} s",
                  f'<span style="color:{STATE_COLOURS["failed"] if row.state == "failed" else "#757575"}">'
                  f"{html.escape(row.detail)}</span>"]
        weight = "font-weight:bold;" if row.number == best else ""
        cells.append(f"<tr style='{weight}'>" + "".join(f"<td style='text-align:left'>{v}</td>" for v in values)
                     + "</tr>")
    more = f"<div>({hidden} earlier trials not shown)</div>" if hidden else ""
    return f"{more}<table>{''.join(cells)}</table>"


def importances_text(state: SweepState) -> str:
    if not state.importances:
        return ""
    return "parameter importances (Optuna's get_param_importances): " + ", ".join(
        f"{name} {value:.2f}" for name, value in state.importances.items())


def summary_html(state: SweepState, verdict: str) -> str:
    head = html.escape(headline(state, verdict)).replace("nbtrain", "<b>nbtrain</b>", 1)
    importances = importances_text(state)
    foot = f"<div>{html.escape(importances)}</div>" if importances else ""
    return f'<div class="nbtrain-sweep">{head}{_rows_html(state, True)}{foot}</div>'


def summary_text(state: SweepState, verdict: str) -> str:
    rows = sorted(state.rows.values(), key=lambda r: r.number)
    importances = importances_text(state)
    return "\n".join([headline(state, verdict), *("  " + row_line(r, state.metric) for r in rows),
                      *([importances] if importances else [])])


def curves_svg(state: SweepState) -> str:
    """The trials' curves overlaid (live; the PNG replaces it at the end)."""
    lines = {n: r.curve for n, r in state.rows.items() if r.curve.count}
    if not lines:
        return ""
    svg = panel_svg(state.metric, lines)
    for n in lines:  # the chart names a line by rank; here each is a trial
        svg = svg.replace(f"<title>rank {n}</title>", f"<title>trial {n}</title>")
    return svg


def curves_figure(state: SweepState):
    """A matplotlib Figure: every trial's metric by step, the best one bold, pruned ones dashed;
    beside it, once the sweep knows its parameters' importances, each complete trial's value
    against the most important parameter (Optuna's slice plot, for one parameter)."""
    from matplotlib.figure import Figure

    top = slice_points(state)
    fig = Figure(figsize=(9.0 if top else 6.0, 3.0), dpi=100)
    axes = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]}) if top else [fig.subplots()]
    ax = axes[0]
    best = state.best[0] if state.best else None
    values = []
    for number_, row in sorted(state.rows.items()):
        steps, ys = row.curve.points()
        if not steps:
            continue
        values += [v for v in ys if math.isfinite(v)]
        is_best = number_ == best
        ax.plot(steps, ys, color=BEST_COLOUR if is_best else "#9e9e9e", linewidth=2.2 if is_best else 1.0,
                linestyle="--" if row.state == "pruned" else "-", label=f"trial {number_} (best)" if is_best else None,
                zorder=3 if is_best else 2)
    if use_log_scale(state.metric, values):
        ax.set_yscale("log")
    ax.set_title(f"{state.metric} per trial (dashed: pruned)", fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, color="#e6e6e6", linewidth=0.6)
    from matplotlib.lines import Line2D

    # What the grey and the dashed lines are, beside the best trial's own entry.
    keys = [Line2D([], [], color="#9e9e9e", linewidth=1.0, label="other trials")]
    if any(row.state == "pruned" for row in state.rows.values()):
        keys.append(Line2D([], [], color="#9e9e9e", linewidth=1.0, linestyle="--", label="pruned"))
    handles, _ = ax.get_legend_handles_labels()
    if handles or len(state.rows) > 1:
        ax.legend(handles=handles + keys, fontsize=8, frameon=False)
    if top:
        name, xs, ys, bests = top
        side = axes[1]
        side.scatter(xs, ys, s=14, c=[BEST_COLOUR if b else "#9e9e9e" for b in bests], zorder=3)
        if all(isinstance(x, (int, float)) and x > 0 for x in xs) and max(xs) > 100 * min(xs):
            side.set_xscale("log")
        side.set_title(f"{state.metric} by {name} (most important)", fontsize=10, loc="left")
        side.set_xlabel(name, fontsize=9)
        side.tick_params(labelsize=8)
        side.grid(True, color="#e6e6e6", linewidth=0.6)
    fig.tight_layout()
    return fig


def slice_points(state: SweepState):
    """(the most important parameter, its values, the complete trials' values, which is the best),
    or None: no importances, or fewer than two complete trials that used it."""
    if not state.importances:
        return None
    name = next(iter(state.importances))
    best = state.best[0] if state.best else None
    rows = [r for r in state.rows.values() if r.state == "complete" and r.value is not None and name in r.params]
    if len(rows) < 2:
        return None
    values = [r.params[name] for r in rows]
    if not all(isinstance(v, (int, float)) for v in values):
        values = [str(v) for v in values]  # a categorical parameter: its choices along the axis
    return name, values, [r.value for r in rows], [r.number == best for r in rows]


def curves_bundle(state: SweepState) -> dict | None:
    if not any(r.curve.count for r in state.rows.values()):
        return None
    if not have_matplotlib():  # the live chart showed them; no line about an optional package at the end
        return None
    try:
        picture = png(curves_figure(state))
    except Exception as exc:  # a picture must never hide how the sweep ended
        log.warning("could not draw the sweep's curves: %s", exc)
        return None
    return {"image/png": base64.b64encode(picture).decode("ascii"), "text/plain": f"{state.metric} per trial"}


class QuietView:
    """progress=False: nothing drawn; the trials' own output still shown."""

    def _write(self, text: str) -> None:
        print(text, flush=True)

    def start(self, state: SweepState) -> None:
        pass

    def output(self, text: str, stream: str = "stdout") -> None:
        """A trial's output line (tagged with its trial) or a note."""
        if stream == "stderr":
            print(text, file=sys.stderr, flush=True)
        else:
            self._write(text)

    def update(self, state: SweepState) -> None:
        pass

    def finish(self, state: SweepState, verdict: str) -> None:
        pass


class TextView(QuietView):
    """A line when a trial starts and when it ends (with the best so far); the summary at the end."""

    def __init__(self, file=None):
        self._file = file
        self._said: dict[int, str] = {}

    def _write(self, text: str) -> None:
        print(text, file=self._file or sys.stdout, flush=True)

    def start(self, state: SweepState) -> None:
        self._write(f"nbtrain: {state.title} on {state.slots}: {state.target} trials ({state.earlier} done earlier); "
                    f"{state.direction} {state.metric}")

    def update(self, state: SweepState) -> None:
        for number_, row in sorted(state.rows.items()):
            if self._said.get(number_) != row.state:
                self._said[number_] = row.state
                end = f"; {best_text(state)}" if row.state != "running" else ""
                self._write(f"nbtrain: {row_line(row, state.metric)}{end}")

    def finish(self, state: SweepState, verdict: str) -> None:
        self.update(state)
        self._write(summary_text(state, verdict))


class HtmlView(QuietView):
    """Jupyter: the table replaced in place at most every REDRAW_INTERVAL s; the summary at the end."""

    def __init__(self):
        self._handles = (None, None)
        self._drawn, self._seen = 0.0, -1

    def start(self, state: SweepState) -> None:
        self._handles = (show(self._table(state), display_id=True), show({"text/plain": ""}, display_id=True))

    def _table(self, state: SweepState) -> dict:
        head = html.escape(headline(state)).replace("nbtrain", "<b>nbtrain</b>", 1)
        return {"text/html": f'<div class="nbtrain-sweep">{head}{_rows_html(state, False)}</div>',
                "text/plain": f"{headline(state)} (live; replaced by a summary when the sweep ends)"}

    def update(self, state: SweepState) -> None:
        now = time.monotonic()
        if now - self._drawn < REDRAW_INTERVAL or (state.version == self._seen and now - self._drawn < 1.0):
            return
        self._drawn, self._seen = now, state.version
        replace(self._handles[0], self._table(state))
        svg = curves_svg(state)
        if svg:
            replace(self._handles[1], {"text/html": svg, "text/plain": ""})

    def finish(self, state: SweepState, verdict: str) -> None:
        replace(self._handles[0],
                {"text/html": summary_html(state, verdict), "text/plain": summary_text(state, verdict)})
        replace(self._handles[1], curves_bundle(state) or {"text/plain": ""})


def make_view(progress=True):
    """The view for `sweep(progress=...)`: as `make_display` chooses (NBTRAIN_PROGRESS too)."""
    if progress is not None and not isinstance(progress, (bool, str)):
        raise ValueError(f"progress={progress!r}: a sweep takes True or 'auto', 'widgets' (the live table in Jupyter), "
                         "'text' or False.")
    check_progress(progress)
    env = os.environ.get("NBTRAIN_PROGRESS", "").strip().lower()
    if progress is False or env == "0":
        return QuietView()
    mode = progress.strip().lower() if isinstance(progress, str) else (env if env not in ("", "1") else "auto")
    if mode == "widgets" or (mode == "auto" and in_jupyter()):
        return HtmlView()
    return TextView()
