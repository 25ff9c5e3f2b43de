"""A rank's whole tree of processes: what its code started must end with it.

A process group reaches a rank's DataLoader workers, but not a child started in a session of
its own (`Popen(..., start_new_session=True)`, a server, a daemon), and not one orphaned when
its parent died: Linux hands those to init. A rank that is a child subreaper gets its orphaned
descendants instead, so it can find and end every one of them when it ends (Linux only; a
no-op elsewhere).

A rank killed outright cannot: a rank that died by its parent-death signal (SIGKILL, since a
rank blocked in a collective ignores anything milder) when the kernel was killed left what it
started running. So each rank on the kernel's machine has a watcher (`watch_rank`): a small
interpreter of its own, the rank's child, that waits for the rank's parent (the kernel, the
template, the launcher, a submitted run's supervisor) to end, then stops the rank, ends its
whole tree and kills it; it dies with the rank otherwise. Measured against the alternatives: a
keeper process above each rank (a second fork of the kernel's size) made a forked launch 50%
slower, a watchdog beside the rank finds nothing once the rank is gone, and a cgroup needs a
delegated hierarchy that kernels on shared machines rarely get.

Run as a script (`python -I -S process_tree.py RANK PARENT`), this module is that watcher: it
needs nothing but the standard library.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
WATCH_INTERVAL = 0.25  # seconds between the watcher's looks at the rank's parent
_watcher: list[int] = []  # this rank's watcher, spared by its own end_descendants


def become_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def watch_rank(parent_pid: int) -> bool:
    """Start this rank's watcher (see the module's doc), for a rank whose parent is `parent_pid`;
    whether it runs. Its output goes nowhere; it stays in the rank's process group."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__),
                                                  str(os.getpid()), str(parent_pid)], dict(os.environ),
                                 file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)])
        finally:
            os.close(devnull)
    except (OSError, AttributeError):  # no posix_spawn, or no interpreter to run
        return False
    _watcher[:] = [pid]
    return True


def _watch(rank: int, parent: int) -> None:
    """The watcher's life: until the rank's parent is gone (the rank is then reparented), or the
    rank itself (this process dies with it)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != rank:  # the rank is gone already
        return
    while _parent_of(rank) == parent:
        time.sleep(WATCH_INTERVAL)
    if os.getppid() != rank:
        return
    os.kill(rank, signal.SIGSTOP)  # it starts nothing more, and this process lives on while it ends the rest
    end_descendants(rank, spare=(os.getpid(),))
    os.kill(rank, signal.SIGKILL)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


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


def end_descendants(pid: int | None = None, grace: float = 1.0, spare: tuple[int, ...] | None = None) -> None:
    """SIGTERM every descendant of `pid` (this process by default) but those in `spare` (this
    rank's watcher by default, which dies with it), SIGKILL what is left after `grace` seconds;
    this process's own children are reaped."""
    pid = pid or os.getpid()
    spare = set(_watcher if spare is None else spare)
    if not [p for p in descendants(pid) if p not in spare]:
        return
    _signal_all(pid, signal.SIGTERM, spare)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _reap_some(pid, spare):
        time.sleep(0.02)
    _signal_all(pid, signal.SIGKILL, spare)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and _reap_some(pid, spare):
        time.sleep(0.02)


def _signal_all(pid: int, sig: int, spare: set[int]) -> None:
    for child in descendants(pid):
        if child in spare:
            continue
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap_some(pid: int, spare: set[int]) -> bool:
    """Collect this process's ended children; whether any descendant is still running."""
    if pid == os.getpid():
        while True:
            try:
                ended, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not ended:
                break
    return any(_running(child) for child in descendants(pid) if child not in spare)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":  # a rank's watcher, started by watch_rank
    _watch(int(sys.argv[1]), int(sys.argv[2]))
