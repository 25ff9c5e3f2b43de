"""A rank's whole tree of processes: what its code started must end with it.

A process group reaches a rank's DataLoader workers, but not a child started in a session of
its own (`Popen(..., start_new_session=True)`, a server, a daemon), and not one orphaned when
its parent died: Linux hands those to init. A rank that is a child subreaper gets its orphaned
descendants instead, so it can find and end every one of them when it ends (Linux only; a
no-op elsewhere).

A rank killed outright cannot: when the kernel dies, its ranks die by SIGKILL (a rank blocked in
a collective would ignore anything milder) and what they started would live on. So the process a
placement starts is a keeper (`keep_rank`): it forks the rank (or the warm template, which forks
ranks) and stays, a subreaper above it, until that ends (it then exits as it did) or its own
parent does (it then kills it and ends everything left below, which Linux hands to the keeper).
The alternatives: a watchdog beside the rank finds nothing once the rank is gone (its orphans go
to init at once), a cgroup needs a delegated hierarchy that kernels on shared machines rarely
get, and a rank cannot both die at once and clean up. The price is a second fork of the
kernel's size for each forked rank (see benchmarks/RESULTS.md); ranks of the template pay none.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PARENT_GONE = signal.SIGUSR2  # the keeper's parent-death signal
_WAITED = {signal.SIGCHLD, signal.SIGTERM, PARENT_GONE}


def become_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):  # not Linux
        pass


def keep_rank(parent_pid: int) -> None:
    """Fork the rank: in the child this returns, and the child goes on to be the rank. This
    process stays as its keeper and never returns.

    The keeper ends with the rank, exiting as it did (its code or its signal), so whoever
    started it sees the rank's end; if `parent_pid` ends first (the kernel, the template, the
    launcher), it kills the rank and ends every process below. It holds no file of the rank's
    (a pipe's end of file is the rank's alone), ignores SIGINT and SIGUSR1 (what reaches its
    process group is meant for the rank) and passes SIGTERM on.
    """
    become_subreaper()
    rank = os.fork()
    if rank == 0:
        return
    try:
        signal.set_wakeup_fd(-1)  # an inherited event loop's: closed below
        _close_files()
        for sig in (signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
        _prctl(PR_SET_PDEATHSIG, PARENT_GONE)
        while True:
            status = _reaped(rank)
            if status is not None:
                end_descendants()  # what the rank left, orphaned: this process inherited it
                _exit_as(status)
            if os.getppid() != parent_pid:  # the parent's death, or a thread of it ending: ask which
                _kill(rank, signal.SIGKILL)
                end_descendants()
                os._exit(1)
            got = signal.sigtimedwait(_WAITED, 1.0)
            if got is not None and got.si_signo == signal.SIGTERM:
                _kill(rank, signal.SIGTERM)
    finally:
        os._exit(1)  # never back into the caller's code


def _close_files() -> None:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux
        return
    for fd in map(int, names):
        if fd > 2:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, closed already
                pass


def _reaped(rank: int) -> int | None:
    """Collect ended children (the rank, orphans it left); the rank's wait status once it ended."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if not pid:
            return found
        if pid == rank:
            found = status


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _exit_as(status: int) -> None:
    """Exit with the rank's code, or die of its signal."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # this process's core would be a copy of the kernel
    try:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
    except (OSError, ValueError):  # SIGKILL has no handler to reset
        pass
    os.kill(os.getpid(), -code)
    os._exit(128 - code)


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

