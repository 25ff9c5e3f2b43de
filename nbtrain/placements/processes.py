"""ddp_fork and ddp_spawn: ranks as processes of the `multiprocess` package (dill inside).

Each rank gets its own stdout and stderr pipes, read by the notebook, so C-level output and
a dying rank's last words (faulthandler's dump) are never lost.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import warnings

from ..common.preflight import check_fork
from ..rank.process import die_with_parent, enable_stacks, limit_threads, redirect_output
from .base import Job, ProcessLauncher, RankProcess, rank_environ
from ..common.transfer import pack_job
from ..rank.loop import serve

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


def _become_rank(parent_pid: int, env: dict, stdout_fd: int, stderr_fd: int, forked: bool) -> None:
    try:
        os.setpgid(0, 0)  # stops reach the rank's own children; the kernel's Ctrl-C does not
    except OSError:
        pass
    die_with_parent(parent_pid, thread_bound=env.get(PARENT_THREAD_VAR) != "other")
    redirect_output(stdout_fd, stderr_fd)
    os.environ.update(env)
    enable_stacks()
    limit_threads(int(env["LOCAL_WORLD_SIZE"]), forked_from_kernel=forked)


def _fork_main(first, live, env, stdout_fd, stderr_fd, inherited_fds, parent_pid):
    for fd in inherited_fds:  # other ranks' pipe ends: holding them would hide their EOF
        try:
            os.close(fd)
        except OSError:
            pass
    _close_listening_sockets()
    _become_rank(parent_pid, env, stdout_fd, stderr_fd, forked=True)

    os._exit(serve(first, once=not live, live=live))


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


def _spawn_main(first, live, env, stdout_conn, stderr_conn, parent_pid):
    _become_rank(parent_pid, env, stdout_conn.fileno(), stderr_conn.fileno(), forked=False)
    stdout_conn.close()
    stderr_conn.close()

    os._exit(serve(first, once=not live, live=live))


def _own_group(pid: int) -> None:
    # Both sides call setpgid, so the group exists whichever runs first.
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already exec'd or set it
        pass


def _handle(proc, ranks: list[int]) -> RankProcess:
    ended: list[int] = []  # the exit code, kept: a closed process object cannot be asked again

    def poll() -> int | None:
        if not ended and proc.exitcode is not None:
            ended.append(proc.exitcode)
        return ended[0] if ended else None

    def join(timeout: float) -> None:
        if not ended:
            proc.join(timeout)

    def close() -> None:
        if poll() is not None and not proc._closed:
            proc.close()

    return RankProcess(ranks, proc.pid, poll, join, close)


class _Pipes:
    """stdout and stderr pipes for every rank, read ends handed to the output pump."""

    def __init__(self, ranks: list[int], pump):
        self.write_ends: dict[int, tuple[int, int]] = {}
        self.read_ends: list[int] = []
        for rank in ranks:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            pump.add(out_r, rank, "stdout")
            pump.add(err_r, rank, "stderr")
            self.write_ends[rank] = (out_w, err_w)
            self.read_ends += [out_r, err_r]

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
        import multiprocess

        context = multiprocess.get_context("fork")
        pipes = _Pipes(job.ranks, pump)
        every_end = pipes.read_ends + [fd for fds in pipes.write_ends.values() for fd in fds]
        try:
            for local, rank in enumerate(job.ranks):
                env = {**rank_environ(job, local, channel_env), **parent_thread()}
                env.setdefault("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))
                out_w, err_w = pipes.write_ends[rank]
                others = [fd for fd in every_end if fd not in (out_w, err_w)]
                proc = context.Process(target=_fork_main, name=f"nbtrain-rank{rank}",
                                       args=(job.first, job.live, env, out_w, err_w, others, os.getpid()))
                with warnings.catch_warnings():
                    # A kernel always has threads (Python 3.12+ warns on every fork). The child
                    # touches none of their state: it replaces the kernel's streams and runs
                    # only the rank's own code; the kernel was warmed before forking.
                    warnings.filterwarnings("ignore", message=".*multi-threaded, use of fork", category=DeprecationWarning)
                    proc.start()
                _own_group(proc.pid)
                started.append(_handle(proc, [rank]))
        finally:
            pipes.close_write_ends()


@contextlib.contextmanager
def _without_main_module():
    """Spawned ranks must not re-run the notebook's or script's main module: the job travels
    whole with dill, and re-running a script's top level in every rank would repeat its work
    (and launch again, without a `__main__` guard). And each starts in a process group of its own."""
    from multiprocess import spawn

    original, command_line = spawn.get_preparation_data, spawn.get_command_line

    def preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    def own_group_first(**kwds):
        # The child's first statement: a process group of its own. The kernel's setpgid comes
        # too late (the child has exec'd), and until the child's own, seconds later, after
        # importing torch, Jupyter's interrupt (sent to the kernel's whole group) reached it
        # there: a KeyboardInterrupt traceback from each rank in the cell.
        line = command_line(**kwds)
        if "-c" in line:
            at = line.index("-c") + 1
            line[at] = "import os; os.setpgid(0, 0); " + line[at]
        return line

    spawn.get_preparation_data, spawn.get_command_line = preparation_data, own_group_first
    try:
        yield
    finally:
        spawn.get_preparation_data, spawn.get_command_line = original, command_line


class SpawnLauncher(ProcessLauncher):
    strategy = "ddp_spawn"
    local = True

    def _prepare(self, job: Job) -> None:
        if not job.live and "payload" not in job.options:  # start_ranks_cleanly may have shipped it
            job.options["payload"] = pack_job(job.fn, job.args, job.kwargs)

    def _start(self, job, channel_env, pump, started) -> None:
        import multiprocess
        from multiprocess import resource_tracker
        from multiprocess.connection import Connection

        self._tracker_was_running = resource_tracker._resource_tracker._fd is not None
        context = multiprocess.get_context("spawn")
        pipes = _Pipes(job.ranks, pump)
        try:
            with _without_main_module():
                for local, rank in enumerate(job.ranks):
                    env = {**rank_environ(job, local, channel_env), **parent_thread()}
                    # Connections pickle as inheritable fds: that is how the pipes reach a spawned rank.
                    out_w, err_w = (Connection(fd, readable=False) for fd in pipes.write_ends[rank])
                    proc = context.Process(target=_spawn_main, name=f"nbtrain-rank{rank}",
                                           args=(job.first, job.live, env, out_w, err_w, os.getpid()))
                    try:
                        proc.start()
                    finally:
                        out_w._handle = err_w._handle = None  # the fds are closed once, below
                    _own_group(proc.pid)
                    started.append(_handle(proc, [rank]))
        finally:
            pipes.close_write_ends()

    def _cleanup(self, job: Job) -> None:
        # Spawning starts multiprocess's resource tracker; it would outlive the launch as a
        # child of the kernel. Nothing of ours needs it once the ranks are gone.
        from multiprocess import resource_tracker

        if not getattr(self, "_tracker_was_running", True):
            resource_tracker._resource_tracker._stop()
