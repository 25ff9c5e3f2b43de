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

Lifetime: the template dies with the kernel (parent-death signal and a watchdog); ranks die
with the template (the same), and with the channel to the notebook. The template reaps its
ranks and reports their exit status, since the kernel is not their parent.

Protocol, over a Unix socket pair: the kernel sends a length-prefixed pickle with the rank's
two output pipes attached (SCM_RIGHTS); the template answers ("forked", pid), and later
("exited", pid, exit code) for each rank, on the same socket. Its first message is ("ready",).
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel.distributed", "torch._dynamo",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.utils.data", "dill", "multiprocess",
           "nbtrain.rankloop", "nbtrain.context", "nbtrain.channel", "nbtrain.transfer", "nbtrain.pickling",
           "nbtrain.cell")
READY_TIMEOUT = 120.0  # a cold start imports torch; on a loaded machine that can take a while
_HEADER = struct.Struct("!Q")


# -- framing ---------------------------------------------------------------------------------

def _send(sock: socket.socket, message, fds=()) -> None:
    data = pickle.dumps(message)
    socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    sock.sendall(data)


def _receive(sock: socket.socket, max_fds: int = 0):
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
    from .worker import die_with_parent

    die_with_parent(kernel_pid)
    sock = socket.socket(fileno=control_fd)
    for name in (*PRELOAD, *extra):
        __import__(name)
    import torch

    if torch.cuda.is_initialized():  # a preloaded package did it: forks could not use CUDA
        raise SystemExit("nbtrain template: CUDA was initialised while preloading; refusing to serve")
    _send(sock, ("ready", os.getpid()))
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            try:
                request, fds = _receive(sock, max_fds=2)
            except (EOFError, OSError):
                break  # the kernel is gone
            pid = os.fork()  # from the main thread, with no other thread: nothing held in the child
            if pid == 0:
                sock.close()
                _become_rank(request, fds)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, ("forked", pid))
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))
    os._exit(0)


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the fork: take on the notebook's present state, then serve as a rank. Never returns."""
    try:
        os.setsid()  # its own group: a stop reaches its children (DataLoader workers), nobody's Ctrl-C does
        from .worker import die_with_parent, enable_stacks, limit_threads, redirect_output

        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        import importlib

        importlib.invalidate_caches()  # files created since the template started
        die_with_parent(request["template"])
        redirect_output(*fds)
        for fd in fds:
            os.close(fd)
        enable_stacks()
        limit_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
        from .rankloop import serve

        first = pickle.loads(request["first"])
        code = serve(first, once=not request["live"], live=request["live"])
    except BaseException:  # noqa: B036 - whatever happens, the fork must never return into the template's loop
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


# -- the kernel side ---------------------------------------------------------------------------

class Template:
    """The kernel's handle on its template: start, fork ranks, hear of their exits, stop."""

    def __init__(self, preload: tuple[str, ...] = ()):
        import tempfile

        kernel_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = kernel_end
        self.started = time.monotonic()
        # Its own words (an import warning, a failed start) go to a file, not into whatever cell
        # happens to run: ipykernel forwards fd 2 of the kernel's children to the notebook.
        self._log = tempfile.TemporaryFile(prefix="nbtrain-template-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nbtrain.template", str(template_end.fileno()), str(os.getpid()), *preload],
            pass_fds=[template_end.fileno()], stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)})
        template_end.close()
        self.preload = tuple(preload)
        self.pid: int | None = None
        self.exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._replies: list = []
        self._lock = threading.Lock()  # one fork request at a time
        self._reader = threading.Thread(target=self._read, name="nbtrain-template", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                message, _ = _receive(self._sock)
                with self._changed:
                    if message[0] == "exited":
                        self.exits[message[1]] = message[2]
                    elif message[0] == "ready":
                        self.pid = message[1]
                    else:
                        self._replies.append(message)
                    self._changed.notify_all()
        except (EOFError, OSError):
            with self._changed:
                self._replies.append(("gone",))
                self._changed.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.pid is not None or not self.alive() or self._replies, timeout)
        if self.pid is None:
            ended = not self.alive() or ("gone",) in self._replies
            self._log.seek(0)
            said = self._log.read().decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError("nbtrain's template process " + ("ended before it was ready" if ended else
                               f"was not ready within {timeout:g} s") + (f": {said[0]}" if said else ""))

    def fork(self, env: dict, first, live: bool, fds: list[int]) -> int:
        """A new rank, forked from the template, with `env` over the kernel's environment; its pid."""
        self.wait_ready()
        request = {"env": {**os.environ, **env}, "cwd": os.getcwd(),
                   "path": [os.getcwd() if p == "" else p for p in sys.path],
                   "first": pickle.dumps(first), "live": live, "template": self.pid}
        with self._lock:
            with self._changed:
                self._replies.clear()
            _send(self._sock, request, fds)
            with self._changed:
                self._changed.wait_for(lambda: self._replies, READY_TIMEOUT)
                reply = self._replies.pop(0) if self._replies else ("gone",)
        if reply[0] != "forked":
            raise RuntimeError("nbtrain's template process went away while forking a rank")
        return reply[1]

    def exit_code(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self.exits or not self.alive(), timeout)

    def close(self) -> None:
        try:
            self._sock.close()  # the template leaves its loop on EOF
        except OSError:
            pass
        try:
            self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(2.0)
        self._reader.join(1.0)
        self._log.close()


_template: Template | None = None
_preload: tuple[str, ...] = ()  # the user's own additions (warm_up(preload=...))
_failed: str | None = None  # why the last start failed: not tried again at every launch, only by warm_up()
_guard = threading.Lock()


def template(start: bool = True) -> Template | None:
    """This kernel's template, ready: the running one, or a new one if it died (or never started).

    Raises RuntimeError when it cannot start (and, until `warm_up()` is called again, at once).
    """
    global _template, _failed
    with _guard:
        if _template is not None and not _template.alive():
            _template.close()
            _template = None
        if _template is None and start:
            if _failed:
                raise RuntimeError(f"{_failed} (nbtrain.warm_up() tries again)")
            _template = Template(_preload)
        handle = _template
    if handle is not None and start:
        try:
            handle.wait_ready()
        except RuntimeError as exc:
            with _guard:
                _failed = str(exc)
                if _template is handle:
                    _template = None
            handle.close()
            raise
    return handle


def warm_up(restart: bool = False, preload=None, wait: bool = True) -> float:
    """Start this kernel's template now, so the first CUDA-safe launch is as fast as later ones.

    `preload`: more packages for it to import once (third-party ones every rank imports, e.g.
    `["transformers"]`; never your own modules, which ranks import fresh); None keeps the last
    list, `[]` has none. `restart=True`
    replaces a running one (after changing a variable torch reads at import). Returns the
    seconds since the template was started, once it is ready.
    """
    global _preload, _failed
    if preload is not None:
        if isinstance(preload, str) or not all(isinstance(name, str) and name for name in preload):
            raise TypeError(f"preload={preload!r}: give a list of module names, e.g. ['transformers'].")
        if tuple(preload) != _preload:
            _preload, restart = tuple(preload), True
    if restart:
        stop()
    _failed = None
    if not wait:
        with _guard:
            if _template is None:
                globals()["_template"] = Template(_preload)
        return 0.0
    handle = template()
    return time.monotonic() - handle.started


def stop() -> None:
    """Stop this kernel's template (the ranks it forked stay until their launch ends)."""
    global _template
    with _guard:
        if _template is not None:
            _template.close()
            _template = None


import atexit  # noqa: E402 - registered once the functions exist

atexit.register(stop)

if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
