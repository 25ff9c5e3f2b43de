"""What the notebook is told when a rank's command fails or exits: the user's own frames, not
those of the loop that ran them (`loop.py`), nor the exception the rank inherited from the kernel,
and, for a `sys.exit`, where it was called.
"""
from __future__ import annotations

import sys
import traceback
import types


def user_frames(tb, around: str):
    """The traceback without the frames of `around` (the file of the loop that called the user's
    code) at either end: from the user's first frame to where the user's code was (an interrupt is
    raised in the loop's SIGINT handler, below it)."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while entries and entries[0].tb_frame.f_code.co_filename == around:
        entries.pop(0)
    if not entries or entries[-1].tb_frame.f_code.co_filename != around:
        return entries[0] if entries else None
    while entries and entries[-1].tb_frame.f_code.co_filename == around:
        entries.pop()
    rebuilt = None
    for entry in reversed(entries):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def user_traceback(exc: BaseException, around: str) -> str:
    """`exc` formatted as the user reads it: its frames as `user_frames` keeps them."""
    return "".join(traceback.format_exception(type(exc), exc, user_frames(exc.__traceback__, around)))


# A rank forked while the kernel was handling an exception (a launch from an `except:` block, a
# restart after Ctrl-C) inherits it as the exception being handled: it is not the rank's story.
_inherited: list = [None]


def note_inherited() -> None:
    """Remember the exception being handled as the rank starts (called first thing: `loop.serve`)."""
    _inherited[0] = sys.exc_info()[1]


def cut_inherited(exc: BaseException | None) -> None:
    """Unlink the inherited exception from `exc`'s chain of contexts."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__context__ is not None and exc.__context__ is _inherited[0]:
            exc.__context__ = None
            return
        exc = exc.__context__


def exit_site(exc: SystemExit) -> str:
    """Where the user's code called `sys.exit`: file, line and the line's text."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    line = f" (`{frame.line}`)" if frame.line else ""
    return f"{frame.filename} line {frame.lineno}{line}"
