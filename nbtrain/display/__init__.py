"""Renders what the ranks report: widgets in Jupyter, text elsewhere.

Every display has the same five methods (start, note, output, update, finish); `update` is
called often and each display decides itself how often to draw.
"""
from __future__ import annotations

import os
import sys


def in_jupyter() -> bool:
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def make_display(progress=True):
    from .text import LineDisplay, QuietDisplay, TqdmDisplay

    if progress is False or os.environ.get("NBTRAIN_PROGRESS", "1") == "0":
        return QuietDisplay()
    if progress not in (True, None) and hasattr(progress, "update"):
        return progress  # a display object of the caller's own
    if sys.stderr.isatty() and not in_jupyter():
        return TqdmDisplay()
    return LineDisplay()
