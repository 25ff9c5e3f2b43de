"""The script launcher's own stderr (torchrun, or accelerate / deepspeed on top of it).

Read on a thread of its own: the lines reach the cell until the launcher starts reporting a
failure, and torchrun's failure report is parsed for each failed rank's exit code and PID and
for its "root cause" rank, which the launcher's process handle uses to explain a rank's end.
"""
from __future__ import annotations

import collections
import os
import re
import select
import threading

from ..common import protocol


class LauncherLog:
    """The launcher's own stderr, read on a thread of its own.

    Its lines go to the cell until the launcher starts reporting a failure or is being
    stopped; from then on the WorkerError says it better. torchrun's failure report is
    parsed for each failed rank's exit code and PID.
    """

    TAIL = 60
    _FAILING = re.compile(r"failed \(exitcode|closing signal|death signal|ChildFailedError")
    _RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
    _EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")

    def __init__(self, fd: int, put):
        self.put = put  # where its lines go (the notebook's output reader's)
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL)
        self.exits: dict[int, tuple[int, int]] = {}  # rank: (exit code, pid)
        self.root: int | None = None  # torchrun's "root cause" rank
        self.quiet = False
        self.done = threading.Event()
        self._fd = fd
        self._stop = threading.Event()
        self._section = ""
        self._rank: int | None = None
        self._thread = threading.Thread(target=self._run, name="nbtrain-launcher-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        partial = b""
        try:
            while not self._stop.is_set():
                if not select.select([self._fd], [], [], 0.1)[0]:
                    continue
                chunk = os.read(self._fd, 65536)
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop() if chunk else b""
                for line in lines:
                    self._line(line.decode(errors="replace").rstrip("\r"))
                if not chunk:
                    return
        finally:
            os.close(self._fd)
            self.done.set()

    def _line(self, text: str) -> None:
        self.tail.append(text)
        if self._FAILING.search(text):
            self.quiet = True
        if text.startswith("Root Cause"):
            self._section = "root"
        elif text.startswith("Failures"):
            self._section = "failures"
        rank, exit_ = self._RANK.match(text), self._EXIT.match(text)
        if rank:
            self._rank = int(rank.group(1))
        elif exit_ and self._rank is not None:
            self.exits[self._rank] = (int(exit_.group(1)), int(exit_.group(2)))
            if self._section == "root" and self.root is None:
                self.root = self._rank
        elif not self.quiet and text:
            self.put(protocol.Output(None, "stderr", text))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
