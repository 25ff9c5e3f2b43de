"""A rank's process: lifetime (dies with the notebook), output, stacks on request, threads.

What a rank *does* (the command loop) is `nbtrain/rank/loop.py`; this module only prepares the
process it runs in, for every placement (forked, spawned, template-forked, torchrun, remote).
"""
from __future__ import annotations

import faulthandler
import io
import os
import re
import signal
import sys
import threading
import time

from ..common import protocol
from ..common.kernel_watcher import register
from ..common.output_reader import OutputReader, end_mark, frame_stderr
from ..common.process_tree import end_descendants, prctl, watch_rank

STACKS_SIGNAL = signal.SIGUSR1  # the notebook sends it to see where a rank is stuck
PR_SET_PDEATHSIG = 1
PARENT_THREAD_VAR = "NBTRAIN_PARENT_THREAD"  # "other": started by a thread that may end before the rank


def become_rank(parent_pid: int, env: dict, stdout_fd: int, stderr_fd: int, forked: bool,
                watcher: str | None) -> None:
    """Make this process, started by the kernel (forked or spawned), a rank: a process group of its
    own, dies with the kernel, writes to the notebook's pipes, runs with `env`, shows its stacks."""
    try:
        os.setpgid(0, 0)  # stops reach the rank's own children; the kernel's Ctrl-C does not
    except OSError:
        pass
    die_with_parent(parent_pid, thread_bound=env.get(PARENT_THREAD_VAR) != "other", kernel_watcher=watcher)
    redirect_output(stdout_fd, stderr_fd)
    os.environ.update(env)
    enable_stacks()
    limit_threads(int(env["LOCAL_WORLD_SIZE"]), forked_from_kernel=forked)


def die_with_parent(parent_pid: int, thread_bound: bool = True, watched: bool = True,
                    kernel_watcher: str | None = None) -> None:
    """A rank must not outlive the process that started it (an orphan can sit in gloo forever),
    nor may what it started (`common.process_tree`).

    A rank its kernel started (forked or spawned) registers with the kernel's one watcher
    (`kernel_watcher`, its address: `common.kernel_watcher`), which ends it and its whole tree
    once the kernel is gone. Any other rank, or one whose registration failed, starts a watcher
    process of its own (`watched`; the template, which is no rank, has none), which does the same
    once its parent is gone; a watchdog thread here does the same if that watcher could not start.
    Without a watcher, Linux's parent-death signal kills the process, but only where the *thread*
    that started it is its parent's main thread (`thread_bound`): it fires when that thread ends,
    and a rank started from another thread (live ranks restarted from a thread, a timer) would die
    with that thread.

    The watchdog thread starts a rank's own watcher (its `posix_spawn`, 1-6 ms in a fork of a
    large kernel, overlaps the rank's start-up); `watched_from_here` waits for it before the rank
    runs code that may start a process. Until then the parent-death signal stands in: the rank has
    nothing else to end.
    """
    if thread_bound:
        _parent_death(signal.SIGKILL)
    if kernel_watcher is not None and register(kernel_watcher):
        # The parent-death signal stood until the send returned: a kernel that died before then
        # killed the rank, which had nothing else to end yet. Once it returned, the watcher holds
        # the rank's pidfd, and it reads everything queued before it acts on the kernel's end; so the
        # signal goes now, before any code of the user's runs (the watcher must find the rank alive
        # to end what that code started). Looked at again after the send, for a rank with no
        # signal (started from another thread) whose kernel died before it.
        if os.getppid() != parent_pid:
            os._exit(1)
        if thread_bound:
            _parent_death(0)
        return
    if os.getppid() != parent_pid:  # the parent died before any of this took effect
        os._exit(1)
    _watcher[:] = [threading.Event()] if watched else []
    threading.Thread(target=_watch_parent, args=(parent_pid, _watcher[0] if watched else None),
                     name="nbtrain-watchdog", daemon=True).start()


_watcher: list[threading.Event] = []  # set once this rank's watcher was started (or failed to start)
_watcher_runs: list[bool] = []


def watched_from_here() -> None:
    """Once this rank's watcher runs (`die_with_parent`), it alone ends the rank when the parent is
    gone: no parent-death signal (a launcher's bootstrap set one, in script mode), so the watcher
    kills the rank itself once it has ended the rest. On the main thread (the signal is the
    calling thread's); a no-op where no watcher was started."""
    if not _watcher:
        return
    _watcher.pop().wait()
    if _watcher_runs == [True]:
        _parent_death(0)


def _parent_death(sig: int) -> None:
    prctl(PR_SET_PDEATHSIG, sig)  # not Linux: the watchdog covers it


def _watch_parent(parent_pid: int, watcher: threading.Event | None) -> None:
    if watcher is not None:
        try:
            _watcher_runs[:] = [watch_rank(parent_pid)]
        finally:
            watcher.set()
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    end_descendants()  # a watcher does it first, where there is one
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
    inherited = sys.stdout, sys.stderr
    sys.stdout = io.TextIOWrapper(_Pipe(1), line_buffering=True, errors="replace")
    sys.stderr = io.TextIOWrapper(_Pipe(2, frame=frame_stderr), line_buffering=True, errors="replace")
    for old, new in zip(inherited, (sys.stdout, sys.stderr)):
        _follow(old, new)


class _Pipe(io.RawIOBase):
    """fd 1 or 2 as Python writes to it. What Python writes to stderr goes on the stdout pipe,
    framed, so the notebook reads both streams in the order they were written (two pipes are read
    in whatever order they become ready); `fileno()` is still the real fd, so faulthandler's
    stacks and a subprocess given sys.stderr write to fd 2. One lock: a frame is never split by
    another thread's write."""

    _lock = threading.Lock()

    def __init__(self, fd: int, frame=None):
        super().__init__()
        self.fd, self.frame = fd, frame

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        data = bytes(data)
        out, fd = (self.frame(data), 1) if self.frame else (data, self.fd)
        with self._lock:
            while out:
                out = out[os.write(fd, out):]
        return len(data)


def _follow(old, new) -> None:
    """A kernel's stream object, inherited by a fork, writes where the rank's stream does. Log
    handlers (the kernel's `basicConfig`, a library's) hold it: through the kernel's sockets their
    records would reach the cell untagged, or not at all."""
    if type(old).__module__.startswith("ipykernel"):
        old.write, old.flush = new.write, new.flush


# c10d's store asks reverse DNS for each peer that connects, and warns where there is none (nodes
# known by address only, as on many clusters): a line per connection per rank, and nothing wrong.
UNHEARD = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")
_forwarded: dict[str, threading.Event] = {}  # stream: set when its end mark has gone (forwarded output only)


def forward_output(link) -> None:
    """For ranks with no pipe to the notebook (another machine): fds 1 and 2 become pipes, read
    here by the reader the notebook uses for its own ranks (`common/output_reader.py`), whose
    records go over the channel. Lines that only a rank on another machine writes, and that say
    nothing is wrong (`UNHEARD`), are dropped."""
    def send(record) -> None:
        if isinstance(record, protocol.Output) and UNHEARD.search(record.text):
            return
        link.emit(record)
        if isinstance(record, protocol.OutputEnd):
            _forwarded[record.stream].set()

    reader = OutputReader(send)
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        _forwarded[stream] = threading.Event()
        reader.add(read, link.rank, stream)
    reader.start()
    redirect_output(1, 2)


def end_output(seq: int, marked: bool, timeout: float = 2.0) -> None:
    """After the command `seq`: its end mark on fds 1 and 2 (`marked`: live ranks, whose next
    command's output must not land in this one's cell). A rank that forwards its own output
    writes it in any case, and waits until everything before it is on its way: a command's last
    lines precede its reply. (Streams are flushed by the caller.)"""
    if not (marked or _forwarded):
        return  # a launch's rank on the notebook's machine: its output ends with its process
    for drained in _forwarded.values():
        drained.clear()
    for fd in (1, 2):
        os.write(fd, end_mark(seq))
    for drained in _forwarded.values():
        drained.wait(timeout)


def enable_stacks() -> None:
    # faulthandler.enable() installs its fatal-signal handlers only when it does not count itself
    # enabled; a fork inherits that count from its parent (pytest's worker, a kernel that enabled
    # faulthandler) with the parent's handlers as they are *now*. A library may have replaced them
    # there since (Ray's driver does; ray.shutdown() leaves SIGSEGV and SIGABRT at SIG_DFL): enable
    # would then only change the file, and a fatal signal would end the rank without its report.
    # Disabled first, enable installs them afresh.
    faulthandler.disable()
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def limit_threads(local_world_size: int, forked_from_kernel: bool = False) -> None:
    """Each rank's share of the cores for torch's intra-op threads.

    A rank forked from a process that has run torch ops gets one thread: GNU OpenMP keeps its
    pool's state across fork but not its threads, and the child's first parallel region would
    wait for them forever (a matmul that never returns). Forks of the template (which never
    ran an op), spawned and torchrun-started ranks get their share of the cores.
    """
    import torch

    if forked_from_kernel:
        torch.set_num_threads(1)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
