"""A rank's output pipes read into records: the one reader of printed output, on either side.

The notebook reads the pipes of the ranks on its machine (`Pool`); a rank on another machine
reads its own (its fds 1 and 2 made into pipes: `rank/process.forward_output`) and sends what it
reads over the channel. Either way the reader replays each stream as a terminal shows it
(`lines.Screen`) and hands on `protocol.Output` for each finished line, `protocol.Live` for the
lines a progress bar redraws, and `protocol.OutputEnd` for the end mark a rank writes after a
command (`end_mark`): everything the rank wrote on that stream before it has been handed on.

A rank's stderr as Python writes it (print to sys.stderr, warnings, logging) travels on its
stdout pipe, each write framed (`frame_stderr`), so the two streams arrive in the order the rank
wrote them; the stderr pipe keeps what C code and faulthandler write to fd 2 (`rank/process.py`).
"""
from __future__ import annotations

import os
import select
import selectors
import threading
import time

from . import protocol
from .lines import Screen

END_MARK = "\x00nbtrain-done "  # + the command's seq: a line of its own (a NUL ends what came before it)


def end_mark(seq: int) -> bytes:
    return f"{END_MARK}{seq}\n".encode()


STDERR_FRAME = b"\x00E"  # + the length in 8 hex digits + that many bytes of stderr, on the stdout pipe
_HEADER = len(STDERR_FRAME) + 8


def frame_stderr(data: bytes) -> bytes:
    return STDERR_FRAME + b"%08x" % len(data) + data


class _Frames:
    """A stdout pipe's bytes split back into (stream, bytes) in order; a frame cut by a read is kept
    until its rest comes."""

    def __init__(self, stream: str):
        self.stream, self.pending, self.left = stream, b"", 0  # left: bytes of stderr still to come

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        data, parts = self.pending + chunk, []
        self.pending = b""
        while data:
            if self.left:
                parts.append(("stderr", data[:self.left]))
                data, self.left = data[self.left:], max(0, self.left - len(data))
                continue
            at = data.find(STDERR_FRAME)
            if at < 0:
                keep = 1 if data.endswith(STDERR_FRAME[:1]) else 0  # a header's first byte, its rest to come
                parts.append((self.stream, data[:len(data) - keep]))
                self.pending = data[len(data) - keep:]
                break
            parts.append((self.stream, data[:at]))
            if len(data) - at < _HEADER:
                self.pending = data[at:]
                break
            self.left, data = int(data[at + len(STDERR_FRAME):at + _HEADER], 16), data[at + _HEADER:]
        return [(stream, part) for stream, part in parts if part]


class OutputReader:
    """Reads output pipes on one thread and calls `put(record)` for what they carry; `rank_of`
    may map a line to its rank and text (torchrun prefixes lines with the rank)."""

    def __init__(self, put):
        self.put = put
        self._selector = selectors.DefaultSelector()
        self._screens: dict[tuple[int, str], Screen] = {}
        self._frames: dict[int, _Frames] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sole: dict[int, int] = {}  # fd: the rank that alone holds its write end
        self._reading = threading.Lock()  # held from a read to the hand-over of what it read

    def add(self, fd: int, rank: int | None, stream: str, rank_of=None, sole: bool = False) -> None:
        """Read `fd`; `sole`: only `rank`'s process writes it, so what is left in it once the
        rank ended is the rank's last words (`unread`)."""
        os.set_blocking(fd, False)
        self._frames[fd] = _Frames(stream)
        with self._reading:
            if sole and rank is not None:
                self._sole[fd] = rank
            self._selector.register(fd, selectors.EVENT_READ, (rank, stream, rank_of))

    def unread(self, rank: int) -> bool:
        """Bytes or the end of a pipe only `rank` writes wait to be read: what it wrote before
        it ended (faulthandler's report, a C++ error) is not all handed on yet. A pipe a child of
        the rank still holds, silent, has nothing waiting."""
        with self._reading:
            fds = [fd for fd, owner in self._sole.items() if owner == rank]
            if not fds:
                return False
            waiting = select.poll()
            for fd in fds:
                waiting.register(fd, select.POLLIN)
            return bool(waiting.poll(0))

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
                with self._reading:
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
            parts = [(part_stream, self._screens.setdefault((fd, part_stream), Screen()).feed(part))
                     for part_stream, part in self._frames[fd].feed(chunk)]
        else:  # end of file: the last partial lines are still output
            self._selector.unregister(fd)
            self._sole.pop(fd, None)
            os.close(fd)
            cut = self._frames.pop(fd).pending  # a frame's header the rank never finished: the stream's bytes
            parts = [(stream, self._screens.setdefault((fd, stream), Screen()).feed(cut))] if cut else []
            for name in dict.fromkeys((stream, "stderr")):
                screen = self._screens.pop((fd, name), None)
                if screen is not None:
                    parts.append((name, screen.flush()))
        for part_stream, events in parts:
            self._put(rank, part_stream, rank_of, events)

    def _put(self, rank, stream, rank_of, events) -> None:
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
        with self._reading:
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fd)
                os.close(key.fd)
            self._sole.clear()
        self._selector.close()
