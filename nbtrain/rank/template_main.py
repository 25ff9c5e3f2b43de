"""The warm template: a clean process, started once per kernel, that forks ranks on request.

Spawn is the safe way to start ranks once CUDA is initialised in the kernel, but every spawned
rank imports torch again (1-3 s, more with DDP's lazy imports). The template pays that once:
it is started as a fresh interpreter (never a fork of the kernel), imports the third-party
packages every rank needs, never touches CUDA, and waits. A rank is a fork of it, so it starts
in milliseconds with a clean CUDA state of its own.

Never stale: the template imports only what nothing in the notebook can change (torch and
friends, nbtrain itself). What can change in a session is applied in the rank after the fork:
the kernel's environment variables, `sys.path` and working directory travel with every request,
and the user's own modules are imported by the rank, fresh (they reach it by name inside the
pickled job). One trap: a variable that torch reads *when it is imported* must be set before the
template starts; `warm_up(restart=True)` starts a new one.

Lifetime: the template dies with the kernel (parent-death signal and a watchdog); each rank's
watcher (`common.process_tree`) ends it, and what it started, when the template is gone, and a
rank ends with the channel to the notebook. The template reaps its ranks and reports their exit
status, since the kernel is not their parent.

Protocol, over a Unix socket pair: the kernel sends a length-prefixed pickle with the rank's
two output pipes attached (SCM_RIGHTS); the template answers `protocol.Forked`, and later
`protocol.Exited` for each rank, on the same socket. Its first message is `protocol.TemplateReady`.
A request "ping" is answered `protocol.Pong`: the kernel asks before a launch, so a template that
cannot answer (stopped, say) is noticed in seconds and plain spawn used instead.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import select
import socket
import struct
import sys
import traceback
from pathlib import Path

from ..common import protocol, runlog, session
from .loop import serve
from .process import die_with_parent, enable_stacks, limit_threads, redirect_output

log = logging.getLogger(__name__)

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel.distributed", "torch._dynamo",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.utils.data", "dill",
           "nbtrain.rank.loop", "nbtrain.rank.context", "nbtrain.rank.cell", "nbtrain.common.channel_link",
           "nbtrain.common.transfer", "nbtrain.common.pickling")
READY_TIMEOUT = 120.0  # a cold start imports torch; on a loaded machine that can take a while
_HEADER = struct.Struct("!Q")


# -- framing ---------------------------------------------------------------------------------

def send_message(sock: socket.socket, message, fds=()) -> None:
    data = pickle.dumps(message)
    socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def receive_message(sock: socket.socket, max_fds: int = 0):
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    if not header:
        raise EOFError("the other end closed")
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            raise EOFError("the other end closed")
        header += more
    size, data = _HEADER.unpack(header)[0], b""
    while len(data) < size:
        chunk = sock.recv(min(1 << 20, size - len(data)))
        if not chunk:
            raise EOFError("the other end closed")
        data += chunk
    return pickle.loads(data), fds


# -- the template process ----------------------------------------------------------------------

def _serve(control_fd: int, kernel_pid: int, extra: list[str]) -> None:
    die_with_parent(kernel_pid, thread_bound=os.environ.pop("NBTRAIN_PARENT_THREAD", "") != "other", watched=False)
    sock = socket.socket(fileno=control_fd)
    for name in (*PRELOAD, *extra):
        __import__(name)
    import torch

    if torch.cuda.is_initialized():  # a preloaded package did it: forks could not use CUDA
        raise SystemExit("nbtrain template: CUDA was initialised while preloading; refusing to serve")
    send_message(sock, protocol.TemplateReady(os.getpid()))
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            try:
                request, fds = receive_message(sock, max_fds=2)
            except (EOFError, OSError):
                break  # the kernel is gone
            if request == "ping":
                send_message(sock, protocol.Pong())
            else:
                pid = os.fork()  # from the main thread, with no other thread: nothing held in the child
                if pid == 0:
                    sock.close()
                    if "detach" in request:
                        _detach(request)
                    _become_rank(request, fds)
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                send_message(sock, protocol.Forked(pid))
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                send_message(sock, protocol.Exited(pid, os.waitstatus_to_exitcode(status)))
    os._exit(0)


def _take_on(request: dict) -> None:
    """The notebook's present state, in a fork: its environment, directory and import path."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["path"]
    importlib.invalidate_caches()  # files created since the template started


def _detach(request: dict) -> None:
    """In the fork: start a process that outlives the kernel and this template (a submitted run's
    supervisor), as `python -c` would with torch already imported. Never returns.

    This fork forks again: the grandchild, a session of its own (`cancel()` stops the session
    its pid names), runs `request["detach"]`'s function with `request["args"]`, re-parented away
    from the template at once (the template dies with the kernel; no parent-death signal or
    watchdog survives a fork). This fork records the grandchild's identity in `request["record"]`
    before it exits, so the kernel, which waits for this fork's exit, knows it is on record."""
    try:
        _take_on(request)
        pid = os.fork()
        if pid:
            runlog.write_json(Path(request["record"]), session.identity(pid))
            os._exit(0)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        module_name, _, function = request["detach"].partition(":")
        code = getattr(importlib.import_module(module_name), function)(*request["args"])
        sys.stdout.flush()
        sys.stderr.flush()
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 1
    except BaseException:  # noqa: B036 - whatever happens, the fork must never return into the template's loop
        traceback.print_exc()
        code = 1
    os._exit(code)


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the fork: take on the notebook's present state, then serve as a rank. Never returns."""
    try:
        os.setsid()  # its own group: a stop reaches its children (DataLoader workers), nobody's Ctrl-C does
        _take_on(request)
        die_with_parent(request["template"])
        redirect_output(*fds)
        for fd in fds:
            os.close(fd)
        enable_stacks()
        limit_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
        first = pickle.loads(request["first"])
        code = serve(first, once=not request["live"], live=request["live"], exits=True)
    except BaseException:  # noqa: B036 - whatever happens, the fork must never return into the template's loop
        traceback.print_exc()
        code = 1
    os._exit(code)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
