"""Ending a pool's rank processes: a wait for them to exit on their own, then SIGTERM, SIGKILL,
and the process trees they started. `processes` are placement handles (`placements.base`);
`remote` ones run elsewhere (a cluster's engine), where there is no tree to find or pid to join."""
from __future__ import annotations

import os
import signal
import time

from ...common.process_tree import descendants

STOP_GRACE = 1.0  # between SIGTERM and SIGKILL


def any_alive(processes) -> bool:
    return any(p.poll() is None for p in processes)


def wait_exits(processes, remote: bool, limit: float, note=None, note_after: float = 0.0, said: str = "") -> None:
    """Up to `limit` s for every process to exit; with `note`, `note(said)` once `note_after` s
    passed with some still running (said from here, not from a timer thread: a launch starts no
    thread for it)."""
    deadline = time.monotonic() + limit
    if note is not None:
        join_until(processes, remote, min(deadline, time.monotonic() + note_after))
        if any_alive(processes):
            note(said)
    join_until(processes, remote, deadline)


def join_until(processes, remote: bool, deadline: float) -> None:
    if not remote:  # each join wakes as its process ends, where a look every 2 ms came late
        for p in processes:
            p.join(max(deadline - time.monotonic(), 0.0))
    while any_alive(processes) and time.monotonic() < deadline:  # a remote rank, a launcher's log not read yet
        time.sleep(0.002)


def stop_processes(processes, remote: bool, grace: float = STOP_GRACE) -> None:
    """SIGTERM, `grace` s, then SIGKILL to every process, its group and the tree it started."""
    alive = [p for p in processes if p.poll() is None]
    # A rank ends what its code started when it exits; one stopped here may not, so its tree
    # is found first: once the rank is gone, Linux hands the tree to init (ranks on this
    # machine only).
    trees = [] if remote else [descendants(p.pid) for p in alive]
    for p in alive:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in (pid for tree in trees for pid in tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in processes:
        p.signal(signal.SIGKILL)  # the group too: grandchildren such as DataLoader workers
        p.join(1.0)
        p.close()
