"""A rank's watcher (see `process_tree`), run by `process_tree.watch_rank` as
`python -I -S watcher.py RANK PARENT PIDFD PSUTIL_ROOT`: the rank's child, which ends the rank and
its whole tree once the rank's parent is gone, and dies with the rank otherwise. Or a kernel's
one watcher of all its ranks, run by `kernel_watcher.address` as
`python -I -S watcher.py --kernel KERNEL PIDFD SOCKET PSUTIL_ROOT` (`watch_kernel`).

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
    import signal

    process_tree = _process_tree(psutil_root)

    if pidfd < 0:
        import time

        while process_tree.parent_of(rank) == parent:
            time.sleep(WATCH_INTERVAL)
    if os.getppid() != rank:
        return
    os.kill(rank, signal.SIGSTOP)  # it starts nothing more, and this process lives on while it ends the rest
    process_tree.end_descendants(rank, spare=(os.getpid(),))
    os.kill(rank, signal.SIGKILL)


def watch_kernel(kernel: int, kernel_fd: int, sock_fd: int, psutil_root: str) -> None:
    """Until the kernel (pidfd KERNEL_FD) ends: take each rank's pidfd sent to the bound datagram
    socket SOCK_FD (`kernel_watcher.register`), forget a rank once it ends. Then stop every rank
    still running, end their trees and kill them, and exit. (KERNEL, the kernel's pid, tells `ps`
    and the tests whose watcher it is.)

    It forks first and goes on in the child, in a session of its own (the kernel started it with
    setsid): the kernel reaps the parent at once, so the watcher is no child of the kernel (a kernel's
    children are its user's) and Jupyter's signals to the kernel's process group miss it."""
    if os.fork():
        os._exit(0)
    os.chdir("/")  # it holds no directory of the user's
    low = 3  # nor any descriptor the kernel had not marked close-on-exec (a pipe someone reads to its end)
    for fd in sorted((kernel_fd, sock_fd)):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    import socket

    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(False)
    address = sock.getsockname()
    ranks: dict[int, int] = {}  # pidfd -> pid
    watched = select.poll()
    for fd in (kernel_fd, sock_fd):
        watched.register(fd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in watched.poll()}
        if sock_fd in ready:
            _take(sock, ranks, watched)
        for fd in ready & ranks.keys():  # a rank that ended: forgotten
            watched.unregister(fd)
            os.close(fd)
            del ranks[fd]
        if kernel_fd in ready:
            break
    # What a rank sent before the kernel ended is queued here still: each rank drops its own
    # parent-death signal only once its send returned.
    _take(sock, ranks, watched)
    import signal

    process_tree = _process_tree(psutil_root)

    stopped = {}
    for fd, pid in ranks.items():
        try:
            signal.pidfd_send_signal(fd, signal.SIGSTOP)  # by its pidfd: never another process that took its pid
        except OSError:
            continue
        if not select.select([fd], [], [], 0)[0]:  # stopped, not ended: its pid names it while it stays so
            stopped[fd] = pid
    process_tree.end_trees(list(stopped.values()), spare=())
    for fd in stopped:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.unlink(address)
        os.rmdir(os.path.dirname(address))
    except OSError:  # removed already, as a dead kernel's, by another kernel's first launch
        pass


def _process_tree(psutil_root: str):
    # After the standard library: no module beside this one shadows one of its.
    sys.path += [os.path.dirname(os.path.abspath(__file__)), psutil_root]
    import process_tree  # type: ignore[import-not-found]  # this folder's, by its file (see above)

    return process_tree


def _take(sock, ranks: dict[int, int], watched) -> None:
    """The ranks' pidfds queued on `sock`, each watched from now on."""
    import socket

    while True:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 16)
        except BlockingIOError:
            return
        for fd in fds:
            pid = _pid_of(fd)
            if pid > 0:
                ranks[fd] = pid
                watched.register(fd, select.POLLIN)
            else:
                os.close(fd)


def _pid_of(pidfd: int) -> int:
    """The pid a pidfd names, as Linux reads it (-1 once the process was reaped, 0 if unknown)."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as info:
            for line in info:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


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
    if sys.argv[1] == "--kernel":
        watch_kernel(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
