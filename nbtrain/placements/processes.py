"""ddp_fork and plain spawn: ranks forked from the kernel (`os.fork`), or fresh
interpreters (`subprocess`) that read their first command, already packed by dill, from a pipe.

Each rank gets its own stdout and stderr pipes, read by the notebook, so C-level output and
a dying rank's last words (faulthandler's dump) are never lost.
"""
from __future__ import annotations

import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import IO, Any

from ..common import kernel_watcher
from ..common.channel import FD_VAR
from ..common.preflight import check_fork
from ..common.transfer import pack_job
from ..rank.loop import serve
from ..rank.process import die_with_parent, enable_stacks, limit_threads, redirect_output
from .base import Job, ProcessLauncher, RankProcess, rank_environ

_warm = False
PARENT_THREAD_VAR = "NBTRAIN_PARENT_THREAD"  # "other": started by a thread that may end before the rank


def parent_thread() -> dict[str, str]:
    """What a rank must know of the thread starting it (see `die_with_parent`)."""
    return {} if threading.current_thread() is threading.main_thread() else {PARENT_THREAD_VAR: "other"}


def warm_kernel() -> None:
    """Import once, in the kernel, what every rank would otherwise import after the fork.

    Building DistributedDataParallel lazily imports ~800 modules (~1 s); forked ranks share
    what the kernel already holds. Synchronously: a fork during an import deadlocks the child.
    """
    global _warm
    if not _warm:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel.distributed  # noqa: F401

        _warm = True


def _become_rank(parent_pid: int, env: dict, stdout_fd: int, stderr_fd: int, forked: bool, watcher: str | None) -> None:
    try:
        os.setpgid(0, 0)  # stops reach the rank's own children; the kernel's Ctrl-C does not
    except OSError:
        pass
    die_with_parent(parent_pid, thread_bound=env.get(PARENT_THREAD_VAR) != "other", kernel_watcher=watcher)
    redirect_output(stdout_fd, stderr_fd)
    os.environ.update(env)
    enable_stacks()
    limit_threads(int(env["LOCAL_WORLD_SIZE"]), forked_from_kernel=forked)


def _fork_main(first, live, env, stdout_fd, stderr_fd, inherited_fds, parent_pid, watcher):
    for fd in inherited_fds:  # other ranks' pipe and channel ends: holding them would hide their EOF
        try:
            os.close(fd)
        except OSError:
            pass
    _close_listening_sockets()
    _become_rank(parent_pid, env, stdout_fd, stderr_fd, forked=True, watcher=watcher)

    os._exit(serve(first, once=not live, live=live, exits=True))


def _close_listening_sockets() -> None:
    """A fork holds copies of the kernel's listening sockets (Jupyter's, the channel's): while it
    lives, their ports would stay bound after the kernel is gone. A rank uses none of them."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux
        return
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            sock = socket.socket(fileno=fd)  # borrows the descriptor; detached below
        except OSError:  # not a socket (or already closed: the listing's own descriptor)
            continue
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        finally:
            sock.detach()
        if listening:
            os.close(fd)


# A spawned rank's program. Its first statement takes it out of the kernel's process group
# (where Popen's `process_group=` cannot: Python 3.10): Jupyter interrupts the kernel's whole
# group, and until the rank's own setpgid, seconds later, after importing torch, a Ctrl-C reached
# it there (a KeyboardInterrupt traceback from each rank in the cell). Then it reads the kernel's
# sys.path and argv, so that what the job refers to imports as in the kernel, and its first
# command, whole, before importing anything (the kernel's write waits for no import). The
# notebook's or script's main module is never run again: the job travels whole with dill, and a
# script's top level would launch again.
SPAWNED = ("import os, pickle, sys; os.setpgid(0, 0); sys.path[:], sys.argv[:] = pickle.load(sys.stdin.buffer); "
           "rank = pickle.load(sys.stdin.buffer); "
           "from nbtrain.placements.processes import spawned_main; spawned_main(*rank)")


def spawned_main(first, live, env, parent_pid, watcher):
    _become_rank(parent_pid, env, 1, 2, forked=False, watcher=watcher)  # its stdout and stderr are its pipes already

    os._exit(serve(first, once=not live, live=live, exits=True))


def _own_group(pid: int) -> None:
    # Both sides call setpgid, so the group exists whichever runs first.
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already exec'd or set it
        pass


def _fork(target, *args) -> int:
    """Fork this process to run `target(*args)`, which ends the child with `os._exit`; the child's
    pid. A plain fork: multiprocess's Process flushed the kernel's streams before each fork
    (ipykernel's flush waits for its I/O thread) and ran its own bootstrap in the child, ~1-2 ms
    of every rank's start. `_start` flushes once per launch."""
    pid = os.fork()
    if pid == 0:
        try:
            _quiet_stdin()
            target(*args)
        except BaseException:  # noqa: B036 - a fork must never return into the kernel's code
            traceback.print_exc()
        os._exit(1)  # reached only where the target failed before its own exit
    return pid


def _quiet_stdin() -> None:
    """A rank reads nothing from the kernel's stdin: an `input()` there reads end-of-file at once."""
    try:
        sys.stdin = open(os.devnull, encoding="utf-8")  # the process's stdin for its life
    except OSError:
        pass


def _forked(pid: int, ranks: list[int]) -> RankProcess:
    """A forked rank's process: reaped once (its exit code kept), waited on through a pidfd."""
    ended: list[int] = []
    try:
        exits = [os.pidfd_open(pid)]  # readable once the process has ended
    except (AttributeError, OSError):  # not Linux 5.3+: join looks every 5 ms
        exits = []

    def poll() -> int | None:
        if not ended:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (a kernel that ignores SIGCHLD)
                return None
            if done:
                ended.append(os.waitstatus_to_exitcode(status))
                close()
        return ended[0] if ended else None

    def join(timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while poll() is None and (left := deadline - time.monotonic()) > 0:
            if not exits:
                time.sleep(min(left, 0.005))
            elif select.select(exits, [], [], left)[0] and poll() is None:
                return  # it ended, and someone else reaped it: nothing left to wait for

    def close() -> None:
        while exits:
            os.close(exits.pop())

    return RankProcess(ranks, pid, poll, join, close)


def _spawned(proc: subprocess.Popen, ranks: list[int]) -> RankProcess:
    def join(timeout: float) -> None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    return RankProcess(ranks, proc.pid, proc.poll, join)


class _Pipes:
    """stdout and stderr pipes for every rank, read ends handed to the output pump."""

    def __init__(self, ranks: list[int], pump):
        self.write_ends: dict[int, tuple[int, int]] = {}
        self.read_ends: list[int] = []
        made: list[int] = []
        try:  # every pipe first: one that cannot be made (the open-file limit) leaves none behind
            for rank in ranks:
                out_r, out_w = os.pipe()
                made += [out_r, out_w]
                err_r, err_w = os.pipe()
                made += [err_r, err_w]
                self.write_ends[rank] = (out_w, err_w)
                self.read_ends += [out_r, err_r]
        except OSError:
            for fd in made:
                os.close(fd)
            raise
        for rank, out_r, err_r in zip(ranks, self.read_ends[::2], self.read_ends[1::2]):
            pump.add(out_r, rank, "stdout", sole=True)
            pump.add(err_r, rank, "stderr", sole=True)

    def close_write_ends(self) -> None:
        # After the ranks hold their copies; a rank's death is then EOF on its pipes.
        for fds in self.write_ends.values():
            for fd in fds:
                os.close(fd)
        self.write_ends.clear()


class ForkLauncher(ProcessLauncher):
    strategy = "ddp_fork"
    local = True

    def _prepare(self, job: Job) -> None:
        check_fork()
        warm_kernel()

    def _first_job(self, job: Job):
        return (job.fn, job.args, job.kwargs)  # inherited by the fork: nothing needs to pickle

    def _start(self, job, channel_env, pump, started) -> None:
        for stream in (sys.stdout, sys.stderr):  # what the kernel holds unsent is not sent by its ranks too
            try:
                stream.flush()
            except Exception:  # a closed or odd stream object: nothing to duplicate
                pass
        pipes = _Pipes(job.ranks, pump)
        channels: dict[int, tuple[socket.socket, socket.socket]] = {}
        try:
            # Each rank's channel, connected before it starts: no dial, no challenge (`Hub.adopt`).
            for rank in job.ranks:
                channels[rank] = socket.socketpair()
            watcher = kernel_watcher.address()  # the kernel's one watcher of its ranks, started at its first launch
            every_end = (pipes.read_ends + [fd for fds in pipes.write_ends.values() for fd in fds]
                         + [end.fileno() for pair in channels.values() for end in pair])
            # Everything the forks take is made first: after the first fork each page the kernel writes
            # is copied (the rank shares them), and the next rank would start that much later.
            forks = {}
            for local, rank in enumerate(job.ranks):
                theirs = channels[rank][1]
                env = {**rank_environ(job, local, channel_env), **parent_thread(), FD_VAR: str(theirs.fileno())}
                env.setdefault("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))
                out_w, err_w = pipes.write_ends[rank]
                others = [fd for fd in every_end if fd not in (out_w, err_w, theirs.fileno())]
                forks[rank] = (job.first, job.live, env, out_w, err_w, others, os.getpid(), watcher)
            with warnings.catch_warnings():
                # A kernel always has threads (Python 3.12+ warns on every fork). The child
                # touches none of their state: it replaces the kernel's streams and runs
                # only the rank's own code; the kernel was warmed before forking.
                warnings.filterwarnings("ignore", message=".*multi-threaded, use of fork", category=DeprecationWarning)
                for rank, args in forks.items():
                    pid = _fork(_fork_main, *args)
                    _own_group(pid)
                    started.append(_forked(pid, [rank]))
            # Served once every rank is forked: a reading thread's start (1-2 ms here, the new rank
            # competing for the CPU) no longer delays the next fork; what a rank sends first waits
            # in its socket's buffer.
            for rank in job.ranks:
                self.adopt(channels[rank][0])
        finally:
            pipes.close_write_ends()
            # The ranks' ends, once every rank is forked: a descriptor freed before a fork could be
            # reused by then, and closed by that rank as another's. (An adopted end is detached.)
            for pair in channels.values():
                for end in pair:
                    end.close()


class SpawnLauncher(ProcessLauncher):
    strategy = "ddp_spawn"
    local = True

    def _prepare(self, job: Job) -> None:
        if not job.live and "payload" not in job.options:  # start_ranks_cleanly may have shipped it
            job.options["payload"] = pack_job(job.fn, job.args, job.kwargs)

    def _start(self, job, channel_env, pump, started) -> None:
        # Where Python has it (3.11+), the child leaves the kernel's group before it runs at all.
        own_group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
        pipes = _Pipes(job.ranks, pump)
        watcher = kernel_watcher.address()  # its children, as forked ranks are: the kernel's one watcher
        try:
            for local, rank in enumerate(job.ranks):
                env = {**rank_environ(job, local, channel_env), **parent_thread()}
                out_w, err_w = pipes.write_ends[rank]
                proc = subprocess.Popen([sys.executable, "-c", SPAWNED], stdin=subprocess.PIPE, stdout=out_w,
                                        stderr=err_w, **own_group)
                started.append(_spawned(proc, [rank]))
                _send(proc.stdin, (sys.path, sys.argv), (job.first, job.live, env, os.getpid(), watcher))
        finally:
            pipes.close_write_ends()


def _send(pipe: IO[bytes] | None, *objects) -> None:
    """Pickle `objects` into a spawned rank's stdin (None only without stdin=PIPE), and close it."""
    if pipe is None:
        return
    try:
        with pipe:
            for obj in objects:
                pickle.dump(obj, pipe)
    except BrokenPipeError:  # the rank died starting: the pool reads why from its stderr
        pass
