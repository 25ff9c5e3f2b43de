"""Renders what the ranks report: widgets in Jupyter, text elsewhere.

Every display has the same five methods (start, note, output, update, finish); `update` is
called often and each display decides itself how often to draw.
"""
from __future__ import annotations

import os
import sys

from .rank_output import jupyter_shell
from .text import LineDisplay, QuietDisplay, TqdmDisplay
from .widgets import WidgetDisplay


def in_jupyter() -> bool:
    return jupyter_shell() is not None


MODES = ("auto", "widgets", "text")
ACCEPTED = ("Accepted: True or 'auto' (widgets in Jupyter, text elsewhere), 'widgets', 'text', "
            "False (no progress), or a display object.")
_warned_widgets = False


def make_display(progress=True):
    """The display for `launch(progress=...)`; NBTRAIN_PROGRESS (0, text, widgets) sets the default.

    Notebooks executed headless (nbval, nbconvert) look like Jupyter but draw no widgets:
    NBTRAIN_PROGRESS=text gives them readable lines.
    """
    check_progress(progress)
    env = os.environ.get("NBTRAIN_PROGRESS", "").strip().lower()
    if progress is False or env == "0":
        return QuietDisplay()
    if progress not in (True, None) and hasattr(progress, "update"):
        return progress  # a display object of the caller's own
    mode = progress.strip().lower() if isinstance(progress, str) else (env if env not in ("", "1") else "auto")
    if mode not in MODES:
        where = f"progress={progress!r}" if isinstance(progress, str) else f"NBTRAIN_PROGRESS={env!r}"
        raise ValueError(f"{where} is not a progress display. {ACCEPTED}")
    if mode == "widgets" or (mode == "auto" and in_jupyter()):
        return _widget_display(LineDisplay)
    if mode == "auto" and sys.stderr.isatty():
        return TqdmDisplay()
    return LineDisplay()


def check_progress(progress) -> None:
    """Refuse what is not a progress setting (`progress=2`, a misspelt mode) when it is given, not
    when a display is first needed."""
    if progress is None or isinstance(progress, bool) or hasattr(progress, "update"):
        return
    if not isinstance(progress, str) or progress.strip().lower() not in MODES:
        raise ValueError(f"progress={progress!r} is not a progress display. {ACCEPTED}")


def _widget_display(fallback):
    global _warned_widgets
    try:
        return WidgetDisplay()
    except ImportError as exc:
        display = fallback()
        if not _warned_widgets:  # said once per session, not at every launch
            _warned_widgets = True
            display.note(str(exc))
        return display
