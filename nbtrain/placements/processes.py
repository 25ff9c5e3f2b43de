"""ddp_fork and plain spawn: ranks forked from the kernel (`os.fork`), or fresh interpreters
started by `multiprocess`'s spawn context, whose first command (the job packed by dill) is among
the arguments of their Process.

Each rank gets its own stdout and stderr pipes, read by the notebook, so C-level output and
a dying rank's last words (faulthandler's dump) are never lost.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
import weakref

from ..common import kernel_watcher
from ..common.channel_dial import FD_VAR
from ..common.preflight import check_fork
from ..common.transfer import pack_job
from ..rank import spawned
from ..rank.forked import fork_main, quiet_stdin
from ..rank.process import PARENT_THREAD_VAR
from .base import Job, ProcessLauncher, RankProcess, rank_environ
from .warm import dynamo_page, wants_warm_kernel, warm_kernel


def parent_thread() -> dict[str, str]:
    """What a rank must know of the thread starting it (see `die_with_parent`)."""
    return {} if threading.current_thread() is threading.main_thread() else {PARENT_THREAD_VAR: "other"}


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
            quiet_stdin()
            target(*args)
        except BaseException:  # noqa: B036 - a fork must never return into the kernel's code
            traceback.print_exc()
        os._exit(1)  # reached only where the target failed before its own exit
    return pid


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


def _spawned(proc, ranks: list[int]) -> RankProcess:
    """A spawned rank's process (multiprocess's): its exit code kept, since the process object,
    closed once the rank has ended (its sentinel descriptor released), cannot be asked again."""
    ended: list[int] = []
    closed: list[bool] = []

    def poll() -> int | None:
        if not ended and (code := proc.exitcode) is not None:
            ended.append(code)
        return ended[0] if ended else None

    def join(timeout: float) -> None:
        if not ended:
            proc.join(timeout)  # wakes as the process ends (its sentinel)

    def close() -> None:
        if poll() is not None and not closed:
            closed.append(True)
            _ranks_at_exit.discard(proc)
            proc.close()

    return RankProcess(ranks, proc.pid, poll, join, close)


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
    start = "fork"
    local = True

    def _prepare(self, job: Job) -> Job:
        check_fork()
        if wants_warm_kernel(job):
            warm_kernel()
        return job

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
                forks[rank] = (job.first, job.live, env, out_w, err_w, others, os.getpid(), watcher, dynamo_page())
            with warnings.catch_warnings():
                # A kernel always has threads (Python 3.12+ warns on every fork). The child
                # touches none of their state: it replaces the kernel's streams and runs
                # only the rank's own code; the kernel was warmed before forking.
                warnings.filterwarnings("ignore", message=".*multi-threaded, use of fork", category=DeprecationWarning)
                for rank, args in forks.items():
                    pid = _fork(fork_main, *args)
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
    """Fresh interpreters, started by `multiprocess`'s spawn context: a `Process` per rank, whose
    arguments (the rank's environment, its first command with the job dill packed once for all,
    and the write ends of its output pipes) multiprocess pickles with dill into the child."""

    start = "spawn"
    local = True

    def __init__(self, payload: bytes | None = None):
        self._payload = payload  # the job, packed already (start_ranks_cleanly checked it pickles)

    def _prepare(self, job: Job) -> Job:
        return job if job.live else job.with_options(payload=self._payload or pack_job(job.fn, job.args, job.kwargs))

    def _start(self, job, channel_env, pump, started) -> None:
        context = _spawn_context()
        watcher = kernel_watcher.address()  # its children, as forked ranks are: the kernel's one watcher
        for local, rank in enumerate(job.ranks):
            env = {**rank_environ(job, local, channel_env), **parent_thread()}
            ends = [_output_pipe(context, pump, rank, stream) for stream in ("stdout", "stderr")]
            proc = context.Process(target=spawned.main, name=f"nbtrain-rank{rank}",
                                   args=(job.first, job.live, env, *ends, os.getpid(), watcher))
            try:
                with _starting, _main_stays_here(), _sigint_held():
                    proc.start()
            finally:
                for end in ends:  # the rank holds its copies; its death is then EOF on the pipes
                    end.close()
            started.append(_spawned(proc, [rank]))
            _ranks_at_exit.add(proc)


def _spawn_context():
    """multiprocess's spawn context. Its resource tracker, which each spawn hands to the child,
    is started here, first: starting it unblocks SIGINT (`_sigint_held`). It is the kernel's for
    its life, as the template is, and ends with the kernel and its ranks."""
    import multiprocess
    from multiprocess import resource_tracker

    global _exit_hook
    if not _exit_hook:  # after multiprocess's own (atexit runs the last registered first)
        atexit.register(_end_ranks_at_exit)
        _exit_hook = True
    resource_tracker.ensure_running()
    return multiprocess.get_context("spawn")


def _output_pipe(context, pump, rank: int, stream: str):
    """A pipe for one of the rank's streams: the read end to the notebook's reader (a descriptor
    of its own: the reader closes it), the write end as a Connection, which multiprocess hands
    to the child as a descriptor."""
    reader, writer = context.Pipe(duplex=False)
    try:
        fd = os.dup(reader.fileno())
    finally:
        reader.close()
    pump.add(fd, rank, stream, sole=True)
    return writer


@contextlib.contextmanager
def _sigint_held():
    """SIGINT blocked in this thread while a rank starts: the child inherits the mask and drops
    one sent meanwhile to the kernel's group (`rank/spawned.py`). A Ctrl-C meant for the kernel
    still reaches it: another thread takes it, or this one once unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _MainByName(types.ModuleType):
    """The caller's `__main__` without its file or module name; every other name reads through."""

    def __init__(self, main: types.ModuleType):
        super().__init__("__main__")
        self.__dict__["_main"] = main

    def __getattr__(self, name: str):
        if name == "__file__":
            raise AttributeError(name)
        return getattr(self.__dict__["_main"], name)


@contextlib.contextmanager
def _main_stays_here():
    """Spawned ranks never run the caller's main module again. multiprocess runs it in the child
    (as `__mp_main__`) when it has a file or a module name: a script, `python -m`, never a
    notebook (whose `__main__` has neither). A script's top level would launch again in every
    rank, and the job travels whole with dill anyway: while a rank starts, `__main__` is a
    stand-in without them (a thread that looks up one of the script's classes meanwhile still
    finds it)."""
    main = sys.modules.get("__main__")
    if main is None or not (getattr(getattr(main, "__spec__", None), "name", None)
                            or getattr(main, "__file__", None)):
        yield
        return
    sys.modules["__main__"] = _MainByName(main)
    try:
        yield
    finally:
        sys.modules["__main__"] = main


_exit_hook = False
_starting = threading.Lock()  # one spawned rank starts at a time (launches from threads): `__main__` is process-wide
_ranks_at_exit: weakref.WeakSet = weakref.WeakSet()  # spawned ranks' processes, while the kernel has them


def _end_ranks_at_exit() -> None:
    """At the caller's exit, its spawned ranks end, as they would once it is gone (parent-death
    signal, the kernel's watcher), but first: multiprocess's own exit hook then joins them
    without a bound (live ranks serve until stopped)."""
    alive = [proc for proc in list(_ranks_at_exit) if proc.exitcode is None]
    for proc in alive:
        _spawned(proc, []).signal(signal.SIGKILL)
    for proc in alive:
        proc.join(5.0)
