"""The rank side of every launch: lifetime, output, the user's function, the report home."""
from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import signal
import sys
import threading
import time
import traceback

STACKS_SIGNAL = signal.SIGUSR1  # the notebook sends it to see where a rank is stuck
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """A rank must not outlive the kernel that started it (an orphan can sit in gloo forever)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watchdog below still covers it
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="nbtrain-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Point fds 1 and 2 (C code and faulthandler included) at the notebook's pipes."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a kernel's stream object in a forked child may be unusable
            pass
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")


def enable_stacks() -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def limit_threads(local_world_size: int) -> None:
    # Ranks sharing a machine each get their share of cores, and after a fork the intra-op
    # pool inherited from the kernel must be rebuilt in the child, not reused.
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def _user_traceback(exc: BaseException) -> str:
    # Drop the launcher's own frame: the traceback should start at the user's function.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_rank(load_job) -> int:
    """Run the job as this rank (environment already set); report; return the exit code.

    `load_job()` returns (fn, args, kwargs); it runs inside the report so that a job that
    fails to arrive (unpickling in a spawned rank) is reported like any other failure.
    """
    from .channel import Link
    from .context import Context, set_current
    from .transfer import pack_exception, pack_result

    rank = int(os.environ["RANK"])
    link = Link.from_environ(rank)
    ctx = Context.from_environ(os.environ, link)
    set_current(ctx)
    link.emit("hello", os.getpid())
    try:
        try:
            fn, args, kwargs = load_job()
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # scripts that end with sys.exit(0) finished normally
        ctx.close()
        final, code = ("result", pack_result(value, rank)), 0
    except BaseException as exc:  # KeyboardInterrupt included: the notebook must hear of it
        final, code = ("error", f"{type(exc).__name__}: {exc}", _user_traceback(exc), pack_exception(exc)), 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    link.close(final)
    return code
