"""A rank's output beyond whole lines, as the notebook shows it: redrawn lines and rich display.

In Jupyter:
- The lines a rank's progress bar redraws (`common/lines.py`) are one output per rank and
  stream, updated in place (a display id), and keep their last text when the bar ends.
- Rich display (`IPython.display.display`, display ids and their updates, `clear_output`) from
  the shown rank (rank 0, or the lowest rank a command went to) is published again in the running
  cell. Display ids are prefixed by the rank, so no two ranks' (nor the notebook's) collide.
  Widgets cannot cross processes: their view is dropped, their text kept.
- Other ranks' rich output is counted and said once at the end of the command, never dropped in
  silence (`end`). In Jupyter each rank's output (lines, bars, the rich output not shown) is also
  kept per rank: live tabs while the command runs, one selector per rank after (`rank_tabs.py`).
Elsewhere (a terminal, a log): a redrawn block's last text as lines, and the shown rank's rich
output as its text.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from ..common import protocol
from ..common.words import ranks_words
from .rank_tabs import RankTabs

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KINDS = (protocol.Live, *protocol.RICH)  # the messages `deliver` takes


def jupyter_shell():
    """The kernel's shell when this runs in Jupyter (Colab's and Spyder's subclass it), else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    in_jupyter = shell is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)
    return shell if in_jupyter else None


def tagged(rank, text: str) -> str:
    return text if rank is None else "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))


def deliver(display, message) -> None:
    """A `protocol.Live`, `Display`, `UpdateDisplay` or `ClearOutput` message to `display`. A
    display of the caller's own without `live` and `rich` gets a bar's last lines as output."""
    if isinstance(message, protocol.Live):
        live = getattr(display, "live", None)
        if live is not None:
            live(message.rank, message.stream, message.text, message.done)
        elif message.done:
            for line in message.text.split("\n") if message.text else ():
                display.output(message.rank, message.stream, line)
        return
    rich = getattr(display, "rich", None)
    if rich is not None:
        rich(message)


class RankOutput:
    """`output(rank, stream, line)` is the display's own, for the lines this leaves as text;
    `shown_again()` is called after a rank cleared the cell's output, for the display to show
    itself again."""

    def __init__(self, output, shown_again=None):
        self._output = output
        self._shown_again = shown_again or (lambda: None)
        self.shown_rank = 0
        self._live: dict[tuple, Any] = {}  # (rank, stream): the display handle of its live lines
        self._unshown: Counter = Counter()  # rank: rich outputs not shown
        self._tabs = RankTabs()  # each rank's output, on its own
        self._in_jupyter = False

    def start(self, state) -> None:
        self.shown_rank = min(state.ranks, default=0)
        self._in_jupyter = jupyter_shell() is not None
        self._live.clear()  # a new cell: live lines start afresh there
        self._unshown.clear()
        self._tabs = RankTabs()

    def carry_on(self, other: RankOutput) -> None:
        """Take over from another display's (LazyDisplay's quiet one) in the middle of a command."""
        self.shown_rank, self._live, self._unshown = other.shown_rank, other._live, other._unshown
        self._tabs, self._in_jupyter = other._tabs, other._in_jupyter

    # -- each rank on its own ------------------------------------------------------------
    def line(self, rank, stream: str, text: str) -> None:
        """A whole line a rank printed (the cell shows it tagged): its tab holds it too (drawn at
        the display's next update: lines come many at a time)."""
        if self._in_jupyter and rank is not None:
            self._tabs.line(rank, stream, text)

    def tick(self) -> None:
        """Called as the display updates: the tabs' output that came since they were drawn."""
        if self._in_jupyter:
            self._tabs.tick(self.shown_rank)

    # -- lines a bar redraws -------------------------------------------------------------
    def live(self, rank, stream: str, text: str, done: bool) -> None:
        key = (rank, stream)
        handle = self._live.pop(key, None) if done else self._live.get(key)
        if self._in_jupyter and rank is not None:  # a bar that ends unseen is left as lines, which reach the tab below
            self._tabs.bar(rank, stream, text if handle is not None or not done else "", done)
            self._tabs.tick(self.shown_rank)
        if jupyter_shell() is None or (done and handle is None):
            if done:  # its last state, as lines: what a log or a terminal keeps
                for line in text.split("\n") if text else ():
                    self._output(rank, stream, line)
            return
        from IPython.display import display

        bundle = {"text/plain": tagged(rank, text) if text else ""}
        if handle is not None:
            handle.update(bundle, raw=True)
        elif text:
            self._live[key] = display(bundle, raw=True, display_id=True)

    # -- rich display --------------------------------------------------------------------
    def rich(self, message) -> None:
        """A rank's `protocol.Display`, `UpdateDisplay` or `ClearOutput`."""
        rank, new = message.rank, isinstance(message, protocol.Display)
        if rank != self.shown_rank:
            self._unshown[rank] += new
            self._tabs.add(message)
            if self._in_jupyter:
                self._tabs.tick(self.shown_rank)
            return
        if jupyter_shell() is None:
            text = message.data.get("text/plain") if new else None
            for line in text.split("\n") if text else ():
                self._output(rank, "stdout", line)
            return
        if isinstance(message, protocol.ClearOutput):
            from IPython.display import clear_output

            clear_output(wait=message.wait)
            self._live.clear()  # their outputs are gone: a bar still drawing starts a new one
            self._shown_again()
            self._tabs.shown_again()
            return
        from IPython.display import publish_display_data

        data = {mime: value for mime, value in message.data.items() if mime != WIDGET_VIEW} or {"text/plain": ""}
        transient = message.transient
        if "display_id" in transient:
            transient = {**transient, "display_id": f"nbtrain-rank{rank}-{transient['display_id']}"}
        publish_display_data(data, message.metadata, transient=transient, update=not new)

    def end(self) -> str | None:
        """What was not shown, said once (the display notes it at the end of the command); each
        rank's output, if worth it, as the static summary (in place of the live tabs)."""
        tabs, self._tabs = self._tabs, RankTabs()
        summarised = self._in_jupyter and tabs.end(self.shown_rank)
        if not sum(self._unshown.values()):
            return None
        ranks = sorted(r for r, n in self._unshown.items() if n)
        count = sum(self._unshown.values())
        self._unshown.clear()
        who = ranks_words(ranks)
        if summarised:
            return (f"{who} displayed {count} rich output{'s' if count > 1 else ''} (IPython display: HTML, images, "
                    f"tables): shown above, one selector per rank; rank {self.shown_rank}'s is shown where it was.")
        return (f"{who} displayed {count} rich output{'s' if count > 1 else ''} (IPython display: HTML, images, "
                f"tables) not shown here: only rank {self.shown_rank}'s rich output is shown in the cell.")
