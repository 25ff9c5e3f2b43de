"""A rank's output stream as the cell should show it: whole lines, and the lines a bar redraws.

Progress bars (tqdm, rich, Lightning's) redraw their line with a carriage return, or several
lines with cursor-up escapes, and a pipe carries every redraw. `Screen` replays a stream as a
terminal would, for the few lines at its end that may still be drawn over, and reports

  ("line", text)          a finished line nothing drew over: what a plain print writes
  ("live", text, done)    the lines being redrawn, as they look now (several joined by "\\n");
                          `done`: they are finished, and later live lines are a new block

A carriage return starts its line afresh (as Jupyter renders one). Colour escapes (SGR) are kept,
since Jupyter renders them; the others (cursor moves, erasing, hiding the cursor, titles,
hyperlinks) are carried out or dropped, never passed on. A line holding a NUL (nbtrain's own
end-of-output marks) finishes everything before it, and stands alone as a line.
"""
from __future__ import annotations

import codecs
import re

# A piece of the stream: a line break, a carriage return, an escape sequence (CSI, OSC or a
# two-character one), another control character, or plain text.
_TOKEN = re.compile(r"\r?\n|\r|\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]"
                    r"|[\x01-\x08\x0b-\x1f\x7f]|[^\r\n\x1b\x01-\x08\x0b-\x1f\x7f]+")
_UNFINISHED = re.compile(r"\r\Z|\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)?\Z")  # completed by the next chunk
_CONTROLS = frozenset(map(chr, [*range(1, 9), *range(11, 32), 127]))  # tab and NUL are text
HOLD_LIMIT = 4096  # an escape left open longer than this is not one: it is shown as text
_CSI = re.compile(r"\x1b\[([0-?]*)[ -/]*([@-~])")


class _Row:
    __slots__ = ("text", "drawn")

    def __init__(self, text: str = "", drawn: bool = False):
        self.text, self.drawn = text, drawn  # drawn: redrawn, erased or reached by a cursor move


class Screen:
    """One output stream (a rank's stdout, say): feed it what the pipe gives, get events back."""

    def __init__(self):
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._held = ""  # an escape or carriage return cut by the end of a chunk
        self._rows = [_Row()]
        self._row = 0  # the cursor's row; its column is always the row's end
        self._reach = 0  # how far up the cursor has moved: rows that far above it may be drawn again
        self._up_since_newline = False
        self._hidden = False  # the cursor is hidden: a live display (rich) is drawing
        self._shown = 0  # rows at the top that a "live" event has shown
        self._last_live = ""

    def feed(self, data: bytes) -> list[tuple]:
        text = self._held + self._decode(data)
        held = _UNFINISHED.search(text, max(0, len(text) - HOLD_LIMIT))
        self._held = held.group() if held else ""
        text = text[:held.start()] if held else text
        events: list[tuple] = []
        for token in _TOKEN.findall(text):
            self._apply(token, events)
        self._report_live(events)
        return events

    def flush(self) -> list[tuple]:
        """Everything is finished (end of file): the last rows, even a partial one."""
        events: list[tuple] = []
        if self._held:
            held, self._held = self._held, ""
            for token in _TOKEN.findall(held):
                self._apply(token, events)
        self._drop_fresh_row()
        self._finish(len(self._rows), events)
        self._reset()
        return events

    def _reset(self) -> None:
        self._rows, self._row, self._reach, self._hidden, self._up_since_newline = [_Row()], 0, 0, False, False

    def _drop_fresh_row(self) -> None:
        """The cursor's row, when it is the last and nothing was written on it: no line yet."""
        last = self._rows[-1]
        if self._row == len(self._rows) - 1 and not last.text and not last.drawn:
            self._rows.pop()

    # -- the terminal ----------------------------------------------------------------------
    def _apply(self, token: str, events: list) -> None:
        row = self._rows[self._row]
        if token in ("\n", "\r\n"):
            self._newline(events)
        elif token == "\r":
            row.text, row.drawn = "", True
        elif token[0] == "\x1b":
            self._escape(token, row)
        elif token == "\x08":
            row.text = row.text[:-1]
        elif len(token) == 1 and token in _CONTROLS:
            pass  # bell and other controls mean nothing in a cell
        else:
            row.text += token

    def _escape(self, token: str, row: _Row) -> None:
        csi = _CSI.fullmatch(token)
        if csi is None:
            return  # OSC (titles, hyperlinks), charset and save/restore: nothing to show
        params, final = csi.groups()
        if final == "m":
            row.text += token  # colour: Jupyter renders it
        elif final in "AF":  # cursor up (F: to the start of the line too)
            self._move(-_count(params))
        elif final in "BE":
            self._move(_count(params))
        elif final == "K" and params in ("1", "2") or final == "G" and params in ("", "0", "1"):
            row.text, row.drawn = "", True  # erase the line, or back to its first column
        elif final == "K":
            row.drawn = True  # erase to the end: the cursor is at the end already
        elif final in "hl" and params == "?25":
            self._hidden = final == "l"

    def _move(self, rows: int) -> None:
        target = self._row + rows
        if rows < 0:
            self._reach = max(self._reach, -rows)
            self._up_since_newline = True
        while target >= len(self._rows):
            self._rows.append(_Row(drawn=True))
        self._row = max(0, target)
        self._rows[self._row].drawn = True

    def _newline(self, events: list) -> None:
        left = self._rows[self._row]
        if "\x00" in left.text:  # nbtrain's mark: all before it is finished, and it is a line of its own
            left.text, mark = left.text.split("\x00", 1)
            self._drop_fresh_row()
            self._finish(len(self._rows), events)
            events.append(("line", "\x00" + mark))
            self._reset()
            return
        self._row += 1
        if self._row == len(self._rows):
            self._rows.append(_Row())
            if not self._up_since_newline:
                self._reach = 0  # printing again, below what was drawn: those rows are settled
        else:  # back at the start of a row drawn before (a nested bar's): it is drawn afresh
            self._rows[self._row].text = ""
        self._up_since_newline = False
        if self._hidden:
            return
        # A redrawn line just left may be a bar whose next line is being drawn (tqdm writes a
        # nested bar as newline, text, cursor up, in separate writes): it waits for one more line.
        hold = self._reach or (1 if left.drawn else 0)
        self._finish(self._row - hold, events)

    def _finish(self, count: int, events: list) -> None:
        """The first `count` rows are final: report them and take them off the screen."""
        count = min(count, len(self._rows))
        if count <= 0:
            return
        done, self._rows = self._rows[:count], self._rows[count:] or [_Row()]
        self._row = max(0, self._row - count)
        shown, rest = done[:self._shown], done[self._shown:]
        if shown:
            events.append(("live", _joined(shown), True))
        self._shown, self._last_live = 0, ""  # what is left, if still drawn, shows as a new block
        for row in rest:
            if row.text.strip() or not row.drawn:  # a bar erased when it closed leaves no empty line
                events.append(("line", row.text.rstrip() if row.drawn else row.text))

    def _report_live(self, events: list) -> None:
        # The block: every row while the cursor may go back up; else up to the last one redrawn
        # (plain text after a finished bar is a line of its own, not part of the bar).
        drawn = [i for i, r in enumerate(self._rows) if r.drawn]
        if not (self._reach or drawn):
            return  # nothing redrawn: plain text waits for its line's end
        size = len(self._rows) if self._reach else drawn[-1] + 1
        text = _joined(self._rows[:size])
        if text != self._last_live and (text or self._last_live):
            self._last_live, self._shown = text, size
            events.append(("live", text, False))


def _count(params: str) -> int:
    return int(params) if params.isdigit() and int(params) > 0 else 1


def _joined(rows: list[_Row]) -> str:
    """Rows as shown: a redrawn row without its padding (bars pad to cover a longer past), an
    erased one not at all."""
    return "\n".join(r.text.rstrip() if r.drawn else r.text for r in rows if r.text.strip() or not r.drawn).rstrip("\n")
