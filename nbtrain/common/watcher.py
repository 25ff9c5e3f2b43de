"""A rank's watcher (see `process_tree`), run by `process_tree.watch_rank` as
`python -I -S watcher.py RANK PARENT PIDFD PSUTIL_ROOT`: the rank's child, which ends the rank and
its whole tree once the rank's parent is gone, and dies with the rank otherwise.

One runs beside every rank, so it starts on the fewest modules it can (no site-packages, no
ctypes, no signal: each import is CPU every launch pays, ~17 ms of it with them against ~9
without) and waits on PIDFD, a pidfd of the parent the rank opened and handed down, and a pidfd
of the rank it opens itself: no polling, no CPU while it waits; it returns when the rank ends
first. Only when the parent is gone does it import `process_tree` (by its file, beside this one)
and psutil (from PSUTIL_ROOT) to end the tree. Without pidfds (PIDFD -1: Linux before 5.3) it
imports them at once, takes the parent-death signal to die with the rank, and looks at the
rank's parent every WATCH_INTERVAL seconds.
"""
import os
import select
import sys

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.25  # seconds between looks at the rank's parent, where there is no pidfd


def main(rank: int, parent: int, pidfd: int, psutil_root: str) -> None:
    rank_fd = _pidfd(rank) if pidfd >= 0 else -1  # before the check below: it names the rank, not its pid
    if rank_fd < 0:
        _die_with_rank()
    if os.getppid() != rank:  # the rank is gone already
        return
    if rank_fd >= 0:
        ended, _, _ = select.select([pidfd, rank_fd], [], [])  # readable once that process has ended
        if rank_fd in ended:
            return
    # After the standard library: no module beside this one shadows one of its.
    sys.path += [os.path.dirname(os.path.abspath(__file__)), psutil_root]
    import signal

    import process_tree  # type: ignore[import-not-found]  # this folder's, by its file (see above)

    if pidfd < 0:
        import time

        while process_tree.parent_of(rank) == parent:
            time.sleep(WATCH_INTERVAL)
    if os.getppid() != rank:
        return
    os.kill(rank, signal.SIGSTOP)  # it starts nothing more, and this process lives on while it ends the rest
    process_tree.end_descendants(rank, spare=(os.getpid(),))
    os.kill(rank, signal.SIGKILL)


def _pidfd(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def _die_with_rank() -> None:
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
