"""Waiting for a run directory to change, woken by the change itself rather than by polling.

`Run.result()` waits for a submitted run's end, which the supervisor writes as a new status.json
renamed into the run directory. On Linux an inotify watch of the directory (`IN_MOVED_TO`) wakes
the waiter the moment it lands, whichever process or kernel waits (an attached run too), and a
pidfd of the supervisor wakes it when the supervisor dies without writing anything. Where
neither can be had (not Linux, a file system that reports no events, a SLURM supervisor), the
caller's `backstop` is all there is: a look every so often, as before.
"""
from __future__ import annotations

import ctypes
import os
import select
from pathlib import Path

IN_MOVED_TO = 0x80  # a file renamed into the directory: how every whole run file arrives
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800  # the directory itself went away


def _inotify(path: Path) -> int | None:
    """A non-blocking inotify descriptor watching `path`, or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):  # not Linux (no inotify_init1 in the C library)
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(path), IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF) < 0:
        os.close(fd)
        return None
    return fd


class Changes:
    """Watches a directory (and, optionally, processes) until closed; `wait` sleeps until either
    says something happened, or `backstop` seconds pass."""

    def __init__(self, path: Path):
        self._inotify = _inotify(path)
        self._pidfds: list[int] = []

    @property
    def woken(self) -> bool:
        """Whether a change wakes `wait` (False: every wait lasts its whole backstop)."""
        return self._inotify is not None

    def watch_process(self, pid: int) -> bool:
        """Also wake when process `pid` ends (a pidfd: any process, not only our children). The
        caller checks afterwards that `pid` is still the process it meant (pids are reused)."""
        try:
            self._pidfds.append(os.pidfd_open(pid))
        except (OSError, AttributeError):  # gone already, or no pidfd here (the backstop notices)
            return False
        return True

    def wait(self, backstop: float) -> None:
        watched = [fd for fd in (self._inotify, *self._pidfds) if fd is not None]
        readable = select.select(watched, [], [], backstop)[0] if watched else select.select([], [], [], backstop)[0]
        for fd in readable:
            if fd == self._inotify:
                try:  # drained: the caller reads what changed itself
                    while os.read(fd, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:  # an ended process stays readable: heard once, then no longer watched
                self._pidfds.remove(fd)
                os.close(fd)

    def close(self) -> None:
        for fd in [self._inotify, *self._pidfds]:
            if fd is not None:
                os.close(fd)
        self._inotify, self._pidfds = None, []

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
