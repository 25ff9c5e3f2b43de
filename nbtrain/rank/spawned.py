"""A spawned rank's first code (start='spawn'): the target of the `multiprocess` spawn Process
that `placements/processes.py` starts.

Nothing heavy at module level: the child imports this module while it unpickles its Process,
and `main` leaves the kernel's process group before importing torch (seconds).
"""
from __future__ import annotations

import os
import signal


def main(first, live: bool, env: dict, stdout, stderr, parent_pid: int, watcher: str | None) -> None:
    """Be a rank; `stdout` and `stderr`: the write ends of the notebook's pipes (Connections,
    which multiprocess hands to the child as descriptors)."""
    leave_kernel_group()
    from .loop import serve
    from .process import become_rank

    become_rank(parent_pid, env, stdout.fileno(), stderr.fileno(), forked=False, watcher=watcher)
    stdout.close()  # fds 1 and 2 are the pipes now
    stderr.close()
    os._exit(serve(first, once=not live, live=live, exits=True))


def leave_kernel_group() -> None:
    """A process group of its own, then SIGINT as any rank's.

    Jupyter interrupts the kernel's whole group, and a spawned child starts in it: until here, a
    Ctrl-C reached the rank too (a KeyboardInterrupt traceback from each rank in the cell). The
    launcher starts the child with SIGINT blocked (a blocked signal stays blocked through exec),
    so one sent meanwhile waits; it was the kernel's, and is dropped here (ignoring a pending
    signal discards it) before SIGINT is unblocked.
    """
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGINT, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
