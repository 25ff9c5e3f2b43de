"""A display for short commands on live ranks: their output at once, a dashboard only if needed.

`ranks.exec(...)` or a `%%ranks` cell mostly prints or assigns; a dashboard for each would be
noise. Once a rank reports progress or a metric, the real display (`make_display`) takes over.
"""
from __future__ import annotations

from . import make_display
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
        pass

    def note(self, text: str) -> None:
        self._current.note(text)

    def output(self, rank, stream: str, text: str) -> None:
        self._current.output(rank, stream, text)

    def update(self, state) -> None:
        if self._inner is None and (state.history or any(v.bars for v in state.ranks.values())):
            self._inner = make_display(self._progress)
            self._inner.start(state)
        if self._inner is not None:
            self._inner.update(state)

    def finish(self, state, ok: bool) -> None:
        if self._inner is not None:
            self._inner.finish(state, ok)
