"""A rank's whole tree of processes: what its code started must end with it.

A process group reaches a rank's DataLoader workers, but not a child started in a session of
its own (`Popen(..., start_new_session=True)`, a server, a daemon), and not one orphaned when
its parent died: Linux hands those to init. A rank that is a child subreaper gets its orphaned
descendants instead, so it can find and end every one of them when it ends (Linux only; a
no-op elsewhere).
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux
        pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children (from /proc; [] where absent)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def end_descendants(pid: int | None = None, grace: float = 1.0) -> None:
    """SIGTERM every descendant of `pid` (this process by default), SIGKILL what is left after
    `grace` seconds; this process's own children are reaped."""
    pid = pid or os.getpid()
    if not descendants(pid):
        return
    _signal_all(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _reap_some(pid):
        time.sleep(0.02)
    _signal_all(pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and _reap_some(pid):
        time.sleep(0.02)


def _signal_all(pid: int, sig: int) -> None:
    for child in descendants(pid):
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap_some(pid: int) -> bool:
    """Collect this process's ended children; whether any descendant is still running."""
    if pid == os.getpid():
        while True:
            try:
                ended, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not ended:
                break
    return any(_running(child) for child in descendants(pid))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
