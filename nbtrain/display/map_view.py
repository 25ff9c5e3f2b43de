"""What a map shows: one progress bar of the items done, as results come back.

In Jupyter, one HTML output replaced in place (a display id; no widget, so a saved notebook needs
no kernel to show it), ending as a line that says how the map ended; in a terminal, a tqdm bar;
in a log, a line every few seconds. The map counts; this only draws.
"""
from __future__ import annotations

import html
import os
import sys
import time
from dataclasses import dataclass, field

from . import check_progress, in_jupyter
from .widgets import duration_text, replace, show

REDRAW_INTERVAL = 0.25  # seconds, at most, between redraws in Jupyter
LINE_INTERVAL = 5.0  # seconds between lines in a log


@dataclass
class MapState:
    title: str  # "map of embed on 2 CPU slots"
    total: int | None  # None: the items are an iterator, not drawn to its end yet
    resumed: int = 0  # results read back from the run directory
    done: int = 0  # results in hand, the resumed ones included
    busy: int = 0  # workers running items now
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def rate(self) -> float | None:
        ran, elapsed = self.done - self.resumed, self.elapsed
        return ran / elapsed if ran and elapsed > 0 else None

    def line(self, verdict: str | None = None) -> str:
        rate = self.rate
        speed = f"{rate:.3g} items/s" if rate else ""
        running = not verdict and self.total is not None and self.done < self.total
        eta = f"eta {duration_text((self.total - self.done) / rate)}" if rate and running and self.total else ""
        resumed = f"{self.resumed} resumed from run_dir" if self.resumed else ""
        when = f"{verdict} in {self.elapsed:.1f} s" if verdict else f"{self.busy} busy"
        count = f"{self.done}/{self.total} items" if self.total is not None else f"{self.done} items"
        parts = [count, when, speed, eta, resumed]
        return f"nbtrain {self.title}: " + ", ".join(p for p in parts if p)


class QuietMapView:
    def start(self, state: MapState) -> None:
        pass

    def output(self, text: str, stream: str = "stdout") -> None:
        print(text, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    def update(self, state: MapState) -> None:
        pass

    def finish(self, state: MapState, verdict: str) -> None:
        pass


class LineMapView(QuietMapView):
    def __init__(self, interval: float = LINE_INTERVAL):
        self.interval, self._last = interval, 0.0

    def start(self, state: MapState) -> None:
        self._last = time.monotonic()
        print(state.line(), flush=True)

    def update(self, state: MapState) -> None:
        if time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            print(state.line(), flush=True)

    def finish(self, state: MapState, verdict: str) -> None:
        print(state.line(verdict), flush=True)


class TqdmMapView(QuietMapView):
    def __init__(self):
        self._bar = None

    def start(self, state: MapState) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=state.total, initial=state.done, desc=f"nbtrain {state.title}", unit="item",
                         file=sys.stderr, dynamic_ncols=True)

    def output(self, text: str, stream: str = "stdout") -> None:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr if stream == "stderr" else sys.stdout)

    def update(self, state: MapState) -> None:
        if self._bar is not None and state.total != self._bar.total:  # an iterator's end reached
            self._bar.total = state.total
        if self._bar is not None and state.done != self._bar.n:
            self._bar.update(state.done - self._bar.n)

    def finish(self, state: MapState, verdict: str) -> None:
        if self._bar is not None:
            self.update(state)
            self._bar.close()
        print(state.line(verdict), file=sys.stderr, flush=True)


class HtmlMapView(QuietMapView):
    def __init__(self):
        self._handle, self._drawn, self._shown = None, 0.0, None

    def _bundle(self, state: MapState, verdict: str | None = None) -> dict:
        fraction = state.done / state.total if state.total else 0.0 if state.total is None and not verdict else 1.0
        colour = "#2e7d32" if verdict == "finished" else "#c62828" if verdict == "failed" else "#1565c0"
        bar = (f'<span style="display:inline-block;width:14em;height:0.8em;background:#e0e0e0;vertical-align:middle">'
               f'<span style="display:block;width:{fraction * 100:.1f}%;height:100%;background:{colour}">'
               '</span></span>')
        text = html.escape(state.line(verdict)).replace("nbtrain", "<b>nbtrain</b>", 1)
        return {"text/html": f'<div class="nbtrain-map">{bar} {text}</div>', "text/plain": state.line(verdict)}

    def start(self, state: MapState) -> None:
        self._handle = show(self._bundle(state), display_id=True)
        self._drawn = time.monotonic()

    def update(self, state: MapState) -> None:
        now = time.monotonic()
        if now - self._drawn >= REDRAW_INTERVAL and (state.done, state.busy) != self._shown:
            self._drawn, self._shown = now, (state.done, state.busy)
            replace(self._handle, self._bundle(state))

    def finish(self, state: MapState, verdict: str) -> None:
        replace(self._handle, self._bundle(state, verdict))


def make_map_view(progress=True):
    """The progress view for `map(progress=...)`, chosen as `make_display` chooses."""
    if progress is not None and not isinstance(progress, (bool, str)):
        raise ValueError(f"progress={progress!r}: a map takes True or 'auto', 'widgets' (a bar in Jupyter), 'text' "
                         "or False.")
    check_progress(progress)
    env = os.environ.get("NBTRAIN_PROGRESS", "").strip().lower()
    if progress is False or env == "0":
        return QuietMapView()
    mode = progress.strip().lower() if isinstance(progress, str) else (env if env not in ("", "1") else "auto")
    if mode == "widgets" or (mode == "auto" and in_jupyter()):
        return HtmlMapView()
    if mode == "auto" and sys.stderr.isatty():
        return TqdmMapView()
    return LineMapView()
