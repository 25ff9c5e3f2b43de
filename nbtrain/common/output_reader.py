"""A rank's output pipes read into records: the one reader of printed output, on either side.

The notebook reads the pipes of the ranks on its machine (`Pool`); a rank on another machine
reads its own (its fds 1 and 2 made into pipes: `rank/process.forward_output`) and sends what it
reads over the channel. Either way the reader replays each stream as a terminal shows it
(`lines.Screen`) and hands on `protocol.Output` for each finished line, `protocol.Live` for the
lines a progress bar redraws, and `protocol.OutputEnd` for the end mark a rank writes after a
command (`end_mark`): everything the rank wrote on that stream before it has been handed on.
"""
from __future__ import annotations

import os
import selectors
import threading
import time

from . import protocol
from .lines import Screen

END_MARK = "\x00nbtrain-done "  # + the command's seq: a line of its own (a NUL ends what came before it)


def end_mark(seq: int) -> bytes:
    return f"{END_MARK}{seq}\n".encode()


class OutputReader:
    """Reads output pipes on one thread and calls `put(record)` for what they carry; `rank_of`
    may map a line to its rank and text (torchrun prefixes lines with the rank)."""

    def __init__(self, put):
        self.put = put
        self._selector = selectors.DefaultSelector()
        self._screens: dict[int, Screen] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, fd: int, rank: int | None, stream: str, rank_of=None) -> None:
        os.set_blocking(fd, False)
        self._selector.register(fd, selectors.EVENT_READ, (rank, stream, rank_of))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._read_pipes, name="nbtrain-output", daemon=True)
            self._thread.start()

    def _read_pipes(self) -> None:
        # Pipes may be added while it runs (a restarted pool): wait for them, do not end.
        while not self._stop.is_set():
            if not self._selector.get_map():
                self._stop.wait(0.05)
                continue
            for key, _ in self._selector.select(timeout=0.1):
                self._read(key)

    def _read(self, key) -> None:
        fd, (rank, stream, rank_of) = key.fd, key.data
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            events = self._screens.setdefault(fd, Screen()).feed(chunk)
        else:  # end of file: the last partial line is still output
            self._selector.unregister(fd)
            os.close(fd)
            events = self._screens.pop(fd, Screen()).flush()
        for kind, text, *done in events:  # `lines.Screen`'s ("line", text) and ("live", text, done)
            if kind != "line":  # lines a progress bar redraws
                self.put(protocol.Live(rank, stream, text, *done))
                continue
            who, text = rank_of(text) if rank_of else (rank, text)
            if text.startswith(END_MARK) and text[len(END_MARK):].isdigit():
                self.put(protocol.OutputEnd(who, stream, int(text[len(END_MARK):])))
            else:
                self.put(protocol.Output(who, stream, text))

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until every pipe reached end of file."""
        deadline = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < deadline and self._thread is not None:
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            os.close(key.fd)
        self._selector.close()
