"""A rank's whole tree of processes: what its code started must end with it.

A process group reaches a rank's DataLoader workers, but not a child started in a session of
its own (`Popen(..., start_new_session=True)`, a server, a daemon), and not one orphaned when
its parent died: Linux hands those to init. A rank that is a child subreaper gets its orphaned
descendants instead, so it can find and end every one of them when it ends (Linux only; a
no-op elsewhere).

A rank killed outright cannot: a rank that died by its parent-death signal (SIGKILL, since a
rank blocked in a collective ignores anything milder) when the kernel was killed left what it
started running. So each rank on the kernel's machine has a watcher (`watch_rank`): a small
interpreter of its own, the rank's child, that waits for the rank's parent (the template, the
launcher) to end, then stops the rank, ends its whole tree and kills it; it dies with the rank
otherwise. The ranks a kernel (or a submitted run's supervisor) forks or spawns share one such
watcher instead, the kernel's (`kernel_watcher`). Measured against the alternatives: a
keeper process above each rank (a second fork of the kernel's size) made a forked launch 50%
slower, a watchdog beside the rank finds nothing once the rank is gone, and a cgroup needs a
delegated hierarchy that kernels on shared machines rarely get.

The watcher is `watcher.py`, run as a script; it imports this module by its file once the rank's
parent (or the kernel) is gone, so this module imports nothing but the standard library and psutil. psutil lists
the trees and signals through `psutil.Process`, which checks that a pid still names the process
it was (pids are reused) before it sends anything.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36
_watcher: list[int] = []  # this rank's watcher, spared by its own end_descendants


def become_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(2); False where it failed or there is none."""
    try:
        return _LIBC is not None and _LIBC.prctl(option, value) == 0
    except AttributeError:  # a C library without prctl: not Linux
        return False


try:  # loaded once, as the kernel imports this module: a forked rank has it (~0.4 ms of its start each time)
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def watch_rank(parent_pid: int) -> bool:
    """Start this rank's watcher (`watcher.py`), for a rank whose parent is `parent_pid`; whether it
    runs. It waits on a pidfd of the parent opened here (a pidfd names the process itself, not a
    pid that may be reused); its output goes nowhere; it stays in the rank's process group."""
    try:
        parent = os.pidfd_open(parent_pid)
    except (OSError, AttributeError):  # Linux before 5.3, or not Linux: the watcher polls instead
        parent = -1
    try:
        pid = spawn_watcher([str(os.getpid()), str(parent_pid), str(parent)], [parent] if parent >= 0 else [])
    except (OSError, AttributeError):  # no posix_spawn, or no interpreter to run
        return False
    finally:
        if parent >= 0:
            os.close(parent)
    _watcher[:] = [pid]
    return True


def spawn_watcher(args: list[str], inherited: list[int], setsid: bool = False) -> int:
    """posix_spawn `python -I -S watcher.py ARGS... PSUTIL_ROOT` with the fds `inherited`, its output
    going nowhere; its pid."""
    for fd in inherited:
        os.set_inheritable(fd, True)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        watcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watcher.py")
        psutil_root = os.path.dirname(os.path.dirname(os.path.abspath(psutil.__file__)))
        return os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", watcher, *args, psutil_root],
                              dict(os.environ), setsid=setsid,
                              file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)])
    finally:
        os.close(devnull)


def parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def running(process: psutil.Process) -> bool:
    """Whether `process` has not ended (a zombie has)."""
    try:
        return process.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def tree(pid: int) -> list[psutil.Process]:
    """Every process below `pid` ([] where there is none, or no such process).

    Read from each process's /proc/PID/task/TID/children where Linux keeps them: psutil finds
    children by reading every process's /proc entry (25 ms with ~140 processes on a loaded
    machine), and every rank asks once as it ends, on the launch's critical path."""
    found: list[psutil.Process] = []
    below = [pid]
    while below:
        children = _children(below.pop())
        if children is None:  # no children files here: psutil's way
            try:
                return psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                return []
        for child in children:
            with contextlib.suppress(psutil.Error):  # ended since: nothing below it to find
                found.append(psutil.Process(child))
                below.append(child)
    return found


def _children(pid: int) -> list[int] | None:
    """The children of `pid`, from the children file of each of its threads; [] for a process that
    is gone, None where the kernel keeps no such files (CONFIG_PROC_CHILDREN)."""
    if not _CHILDREN_FILES:
        return None
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listed:
                children += map(int, listed.read().split())
        except OSError:  # the thread (or the process) ended meanwhile
            continue
    return children


_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def descendants(pid: int) -> list[int]:
    """The pids of every process below `pid`."""
    return [p.pid for p in tree(pid)]


def end_descendants(pid: int | None = None, grace: float = 1.0, spare: tuple[int, ...] | None = None) -> None:
    """SIGTERM every descendant of `pid` (this process by default) but those in `spare` (this
    rank's watcher by default, which dies with it), SIGKILL what is left after `grace` seconds;
    this process's own children are reaped."""
    end_trees([pid or os.getpid()], grace, tuple(_watcher) if spare is None else spare)


def end_trees(roots: list[int], grace: float = 1.0, spare: tuple[int, ...] = ()) -> None:
    """`end_descendants` for the trees below each of `roots` at once: one grace for all (a kernel's
    watcher ends every rank's tree)."""
    spared = set(spare)
    if not _below(roots, spared):
        return
    for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        # Listed again each time: an orphan of an ended child is handed to its subreaper.
        for child in _below(roots, spared):
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and _reap_some(roots, spared):
            time.sleep(0.02)


def _below(roots: list[int], spared: set[int]) -> list[psutil.Process]:
    return [p for root in roots for p in tree(root) if p.pid not in spared]


def _reap_some(roots: list[int], spared: set[int]) -> bool:
    """Collect this process's ended children; whether any descendant is still running."""
    if os.getpid() in roots:
        while True:
            try:
                ended, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not ended:
                break
    return any(running(child) for child in _below(roots, spared))
