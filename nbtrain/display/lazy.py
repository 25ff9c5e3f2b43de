"""A display for short commands on live ranks: their output at once, a dashboard only if needed.

`ranks.exec(...)` or a `%%ranks` cell mostly prints or assigns; a dashboard for each would be
noise. Once a rank reports progress or a metric, the real display (`make_display`) takes over.
"""
from __future__ import annotations

from ..common import protocol
from . import make_display
from .rank_output import deliver
from .text import QuietDisplay


class LazyDisplay:
    def __init__(self, progress=True):
        self._progress = progress
        self._inner = None
        self._quiet = QuietDisplay()

    @property
    def _current(self):
        return self._inner or self._quiet

    def start(self, state) -> None:
        self._quiet.start(state)

    def note(self, text: str) -> None:
        self._current.note(text)

    def output(self, rank, stream: str, text: str) -> None:
        self._current.output(rank, stream, text)

    def live(self, rank, stream: str, text: str, done: bool) -> None:
        deliver(self._current, protocol.Live(rank, stream, text, done))

    def rich(self, message) -> None:
        deliver(self._current, message)

    def update(self, state) -> None:
        if self._inner is None and (state.history or any(v.bars for v in state.ranks.values())):
            self._inner = make_display(self._progress)
            self._inner.start(state)
            if hasattr(self._inner, "rank_output"):  # a bar drawing now, what was not shown: carried on
                self._inner.rank_output.carry_on(self._quiet.rank_output)
        if self._inner is not None:
            self._inner.update(state)
        else:
            self._quiet.rank_output.tick()  # the ranks' tabs (Jupyter)

    def finish(self, state, ok: bool) -> None:
        (self._inner or self._quiet).finish(state, ok)
