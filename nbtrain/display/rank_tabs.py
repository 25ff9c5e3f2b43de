"""Each rank's own output, one tab per rank: live while a command runs, a static summary after.

The cell's combined view (every rank's lines tagged `[rank N]`, the shown rank's rich output where
it is drawn: `rank_output.py`) stays as it is. Beside it, each rank's printed lines, its progress
bars as they are drawn now, and its rich display (the other ranks' only: the shown rank's is in
the cell) are kept here, per rank:

- live, in Jupyter with ipywidgets, as a `Tab` of one pane per rank, redrawn at most every
  `REDRAW` s (a pane only when its rank's output changed), once the ranks' output is more than a
  glance: a progress bar, rich output the cell does not show, or more than `AFTER_LINES` lines
  from two ranks or more;
- when the command ends, that view is replaced by plain HTML, a `<details>` selector per rank
  (shown then if the output became worth it only after the last redraw, or without ipywidgets):
  it stays in the saved notebook as a static summary and needs no widget, script or style (a
  notebook's sanitizer keeps it).

A display a rank updated shows its last state; a rank's `clear_output` empties its pane.
"""
from __future__ import annotations

import html
import time
from collections import defaultdict, deque

from ..common import protocol

IMAGES = ("image/png", "image/jpeg", "image/gif")
_END = "\ufffe"  # a display without an id: never matched by an update
KEEP_LINES = 300  # a rank's latest lines kept in its pane (the cell's combined view has them all)
AFTER_LINES = 10  # more lines than this from two ranks or more: the tabs are worth showing
REDRAW = 0.25  # seconds: a pane is redrawn at most this often
STDERR_STYLE = "color:#c62828"
# A live pane scrolls, and starts at its bottom (its latest lines): a reversed column's scroll starts at its end.
LIVE_PANE = '<div style="display:flex;flex-direction:column-reverse;max-height:24em;overflow:auto"><div>{}</div></div>'


class _Pane:
    """One rank's output: lines, then its rich outputs and bars, each in the order they came."""

    def __init__(self):
        self.lines: deque[tuple[str, str]] = deque(maxlen=KEEP_LINES)  # (stream, text)
        self.dropped = 0  # lines older than those kept
        self.outputs: list[tuple[str, dict]] = []  # (display id, data): rich output the cell does not show
        self.bars: dict[str, str] = {}  # stream: the text a bar draws there now
        self.changed = False

    def __bool__(self) -> bool:
        return bool(self.lines or self.dropped or self.outputs or self.bars)

    def line(self, stream: str, text: str) -> None:
        if len(self.lines) == KEEP_LINES:
            self.dropped += 1
        self.lines.append((stream, text))

    def body(self) -> str:
        parts = [f"<pre>… {self.dropped} earlier lines: all are in the cell's output</pre>"] if self.dropped else []
        if self.lines:
            parts.append("<pre>" + "\n".join(_line_html(s, t) for s, t in self.lines) + "</pre>")
        parts += [f"<div>{_as_html(data)}</div>" for _, data in self.outputs]
        parts += [f"<pre>{html.escape(text)}</pre>" for text in self.bars.values() if text]
        return "".join(parts)

    def label(self) -> str:
        lines = len(self.lines) + self.dropped
        counts = [f"{lines} line{'s' if lines != 1 else ''}"] if lines else []
        n = len(self.outputs)
        counts += [f"{n} output{'s' if n != 1 else ''}"] if n else []
        return ", ".join(counts) or "drawing"


class RankTabs:
    def __init__(self):
        self._panes: dict[int, _Pane] = defaultdict(_Pane)
        self._view = None  # the live Tab, once shown
        self._children: dict = {}  # rank: its pane's HTML widget
        self._handle = None  # its display handle: the summary replaces it
        self._drawn = 0.0
        self._failed = False  # ipywidgets missing: no live view, the summary at the end only

    def __bool__(self) -> bool:
        return any(p.outputs for p in self._panes.values())  # what the cell did not show

    # -- what the ranks send ---------------------------------------------------------------
    def add(self, message) -> None:
        """A rank's `protocol.Display`, `UpdateDisplay` or `ClearOutput` the cell does not show."""
        pane = self._panes[message.rank]
        pane.changed = True
        if isinstance(message, protocol.ClearOutput):
            pane.outputs.clear()
            pane.lines.clear()
            pane.dropped = 0
            return
        display_id = message.transient.get("display_id", _END)
        if isinstance(message, protocol.UpdateDisplay):
            pane.outputs[:] = [(i, message.data if i == display_id else d) for i, d in pane.outputs]
        else:
            pane.outputs.append((display_id, message.data))

    def line(self, rank: int, stream: str, text: str) -> None:
        pane = self._panes[rank]
        pane.line(stream, text)
        pane.changed = True

    def bar(self, rank: int, stream: str, text: str, done: bool) -> None:
        """The lines a rank's bar draws now; when `done`, they stay as its last lines."""
        pane = self._panes[rank]
        pane.changed = True
        if not done:
            pane.bars[stream] = text
            return
        pane.bars.pop(stream, None)
        for line in text.split("\n") if text else ():
            pane.line(stream, line)

    # -- the live view -----------------------------------------------------------------------
    def tick(self, shown_rank: int) -> None:
        """Show the live tabs once they are worth it; redraw the panes that changed, if due."""
        now = time.monotonic()
        if now - self._drawn < REDRAW:
            return
        if self._view is None and (self._failed or not self._worth_it(shown_rank) or not self._show()):
            return
        self._drawn = now
        self._draw()

    def _worth_it(self, shown_rank: int) -> bool:
        busy = [p for p in self._panes.values() if p]
        if any(p.outputs for r, p in self._panes.items() if r != shown_rank):
            return True
        lines = sum(len(p.lines) + p.dropped for p in busy)
        return len(busy) > 1 and (any(p.bars for p in busy) or lines > AFTER_LINES)

    def _show(self) -> bool:
        from .widgets import load_ipywidgets, show

        try:
            w = load_ipywidgets()
        except ImportError:  # the dashboard already said how to get them; the summary still comes
            self._failed = True
            return False
        self._view = w.Tab()
        self._view.add_class("nbtrain-rank-tabs")
        self._handle = show(self._bundle(), display_id=True)
        return True

    def _bundle(self) -> dict:
        from .widgets import view_bundle

        return {**view_bundle(self._view), "text/plain": "nbtrain: each rank's output, one tab per rank (live)"}

    def _draw(self) -> None:
        import ipywidgets as w

        ranks = sorted(r for r, p in self._panes.items() if p)
        if len(self._children) != len(ranks):  # a rank's first output: its tab
            for rank in ranks:
                if rank not in self._children:
                    self._children[rank] = w.HTML()
                    self._panes[rank].changed = True
            self._view.children = [self._children[r] for r in ranks]
            self._view.titles = [f"rank {r}" for r in ranks]
        for rank in ranks:
            pane = self._panes[rank]
            if pane.changed:
                pane.changed = False
                self._children[rank].value = LIVE_PANE.format(pane.body())

    def shown_again(self) -> None:
        """The cell was cleared (by the shown rank): the live tabs come back, under the same id."""
        if self._handle is not None:
            from .widgets import show_again

            show_again(self._handle, self._bundle())

    def end(self, shown_rank: int) -> bool:
        """The static summary in the cell: in place of the live tabs, or shown now if they are
        worth it (output that came after the last redraw; no ipywidgets). True if it is there."""
        from .widgets import close_tree, replace, show

        summary = {"text/html": self.html(), "text/plain": self.text()}
        if self._view is None:
            if not self._worth_it(shown_rank):
                return False
            show(summary)
            return True
        replace(self._handle, summary)
        close_tree(self._view, *self._children.values())
        self._view, self._children = None, {}
        return True

    # -- the static summary -----------------------------------------------------------------------
    def html(self) -> str:
        """One `<details>` per rank holding its output, in rank order."""
        parts = [f"<details><summary>rank {rank} ({pane.label()})</summary>{pane.body()}</details>"
                 for rank, pane in sorted(self._panes.items()) if pane]
        return f'<div class="nbtrain-rank-tabs">{"".join(parts)}</div>'

    def text(self) -> str:
        ranks = ", ".join(f"rank {r} ({p.label()})" for r, p in sorted(self._panes.items()) if p)
        return f"nbtrain: each rank's output: {ranks}"


def _line_html(stream: str, text: str) -> str:
    escaped = html.escape(text)
    return f'<span style="{STDERR_STYLE}">{escaped}</span>' if stream == "stderr" else escaped


def _as_html(data: dict) -> str:
    """One output's richest form that HTML holds: its HTML (the rank's code is the user's own), an
    image, else its text."""
    if "text/html" in data:
        return str(data["text/html"])
    for mime in IMAGES:
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}"/>'
    return f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
