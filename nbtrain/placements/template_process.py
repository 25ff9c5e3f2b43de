"""The kernel's handle on its warm template (see `nbtrain.rank.template_main` for what runs
inside it): start it once, fork ranks through it, hear of their exits, stop it with the kernel.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Literal, overload

import psutil

from ..common import protocol
from ..common.errors import NbtrainError
from ..rank.template_main import READY_TIMEOUT, receive_message, send_message
from .processes import parent_thread

ANSWER_SECONDS = 5.0  # a ready template answers a ping in milliseconds: one that does not is unusable
FORK_SECONDS = 10.0  # ... and a fork request in well under a second
GONE = None  # the answer of a template that went away


class TemplateUnresponsive(NbtrainError, RuntimeError):
    """The template runs but does not answer (stopped by SIGSTOP, or hung): ranks cannot come from it."""


class Template:
    """The kernel's handle on its template: start, fork ranks, hear of their exits, stop."""

    def __init__(self, preload: tuple[str, ...] = ()):
        kernel_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = kernel_end
        self.started = time.monotonic()
        # Its own words (an import warning, a failed start) go to a file, not into whatever cell
        # happens to run: ipykernel forwards fd 2 of the kernel's children to the notebook.
        self._log = tempfile.TemporaryFile(prefix="nbtrain-template-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nbtrain.rank.template_main", str(template_end.fileno()), str(os.getpid()),
             *preload],
            pass_fds=[template_end.fileno()], stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            start_new_session=True, env={**os.environ, **parent_thread(),
                                         "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)})
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
                message, _ = receive_message(self._sock)
                with self._changed:
                    if isinstance(message, protocol.Exited):
                        self.exits[message.pid] = message.code
                    elif isinstance(message, protocol.TemplateReady):
                        self.pid = message.pid
                    else:
                        self._replies.append(message)
                    self._changed.notify_all()
        except (EOFError, OSError):
            with self._changed:
                self._replies.append(GONE)
                self._changed.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.pid is not None or not self.alive() or self._replies, timeout)
        if self.pid is None:
            ended = not self.alive() or GONE in self._replies
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
        reply = self._ask(request, fds, FORK_SECONDS)
        if not isinstance(reply, protocol.Forked):
            raise RuntimeError("nbtrain's template process went away while forking a rank")
        return reply.pid

    def detach(self, env: dict, target: str, args: list[str], log: str, record: str) -> None:
        """Start `target` ("module:function", called with `args`) in a process that outlives the
        kernel and this template, its output appended to `log`; returns once `record` names it
        (`session.identity`). A fork of the template: torch is already imported."""
        self.wait_ready()
        request = {"env": {**os.environ, **env}, "cwd": os.getcwd(),
                   "path": [os.getcwd() if p == "" else p for p in sys.path],
                   "detach": target, "args": list(args), "log": log, "record": record}
        reply = self._ask(request, (), FORK_SECONDS)
        if not isinstance(reply, protocol.Forked):
            raise RuntimeError("nbtrain's template process went away while starting a detached process")
        self.wait_exit(reply.pid, FORK_SECONDS)  # the fork in between exits once it has written `record`
        code = self.exit_code(reply.pid)
        if code != 0:
            raise RuntimeError("nbtrain's template process could not start a detached process: "
                               + (f"it did not finish within {FORK_SECONDS:g} s" if code is None else
                                  f"the fork that starts it exited with {code}"))

    def ping(self, timeout: float = ANSWER_SECONDS) -> None:
        """Make sure the template answers; TemplateUnresponsive (saying why, where it can) if not."""
        self.wait_ready()
        if self._ask("ping", (), timeout) is GONE:
            raise RuntimeError("nbtrain's template process went away")

    def _ask(self, request, fds, timeout: float):
        """The template's answer (a `protocol` record), or GONE."""
        with self._lock:
            with self._changed:
                self._replies.clear()
            try:
                send_message(self._sock, request, fds)
            except OSError:
                return GONE
            with self._changed:
                self._changed.wait_for(lambda: self._replies, timeout)
                if self._replies:
                    return self._replies.pop(0)
        if not self.alive():
            return GONE
        raise TemplateUnresponsive(f"nbtrain's template process (PID {self.process.pid}) did not answer within "
                                   f"{timeout:g} s: {_state(self.process.pid)}")

    def exit_code(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self.exits or not self.alive(), timeout)

    def close(self) -> None:
        try:
            # The template leaves its loop on EOF. A close alone sends none while the reader
            # thread is blocked reading this socket (the kernel still holds the connection): the
            # template then waited out the 2 s below and was killed on every stop.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(2.0)
        self._reader.join(1.0)
        self._log.close()


def _state(pid: int) -> str:
    """Why a process may not answer, from its state."""
    try:
        state = psutil.Process(pid).status()
    except psutil.Error:
        return "it is busy or hung"
    return {psutil.STATUS_STOPPED: "it is stopped (SIGSTOP or SIGTSTP; SIGCONT resumes it)",
            psutil.STATUS_TRACING_STOP: "it is stopped by a debugger", psutil.STATUS_DISK_SLEEP:
            "it waits on the disk or a device", psutil.STATUS_ZOMBIE: "it has ended"}.get(state, "it is busy or hung")


_template: Template | None = None
_preload: tuple[str, ...] = ()  # the user's own additions (warm_up(preload=...))
_failed: RuntimeError | None = None  # why the last start failed: not tried again at every launch, only by warm_up()
_unresponsive: list[Template] = []  # stopped answering: left alone (their ranks may live), stopped at exit
_guard = threading.Lock()


@overload
def template(start: Literal[True] = ...) -> Template: ...
@overload
def template(start: bool) -> Template | None: ...


def template(start: bool = True) -> Template | None:
    """This kernel's template, ready: the running one, or a new one if it died (or never started).

    Raises RuntimeError when it cannot start (and, until `warm_up()` is called again, at once).
    """
    global _template, _failed
    with _guard:
        if _template is not None and not _template.alive():
            _template.close()
            _template = None
        fresh = _template is None
        if _template is None and start:
            if _failed:
                raise type(_failed)(f"{_failed} (nbtrain.warm_up() tries again)")
            _template = Template(_preload)
        handle = _template
    if handle is not None and start:
        try:
            handle.ping()  # ready, and answering: a stopped template is noticed here, in seconds
        except TemplateUnresponsive as exc:
            with _guard:
                _failed = exc
                if _template is handle:
                    _template = None
                    _unresponsive.append(handle)  # not killed: ranks forked from it may still be live
            raise
        except RuntimeError as exc:
            with _guard:
                if _template is handle:
                    _template = None
                if fresh:
                    _failed = exc
            handle.close()
            if fresh:
                raise
            # One that ran until now died since (killed): replaced, as a dead one found above is.
            # Its end may not be seen yet (a killed process's threads go one by one), hence here.
            return template(start)
    return handle


def warm_up(restart: bool = False, preload=None, wait: bool = True) -> float:
    """Start this kernel's warm template now, so the first CUDA-safe launch is as fast as the later ones.

    The template is a clean process (never a fork of the kernel) that imports torch and its
    distributed parts once and forks ranks on request: start='template', and start='auto' once
    CUDA is initialised in the kernel. It starts by itself at the first launch that needs it;
    calling this first moves those seconds to a moment of your choosing. It dies with the kernel.

    Parameters
    ----------
    restart : bool, default False
        Replace a running template (after setting an environment variable that torch reads when
        imported).
    preload : list of str, optional
        More packages for the template to import once, e.g. ``["transformers"]``: third-party
        packages every rank imports, never your own modules (ranks import those fresh). None
        keeps the last list; ``[]`` has none. A new list restarts the template.
    wait : bool, default True
        Wait until it is ready; False starts it and returns at once (0.0).

    Returns
    -------
    float
        Seconds since the template was started, once it is ready.

    Raises
    ------
    TypeError
        ``preload`` is not a list of module names.
    RuntimeError
        The template could not start, or does not answer; launches then use plain spawn.
    """
    global _preload, _failed
    if preload is not None:
        if isinstance(preload, str) or not all(isinstance(name, str) and name for name in preload):
            raise TypeError(f"preload={preload!r}: give a list of module names, e.g. ['transformers'].")
        if tuple(preload) != _preload:
            _preload, restart = tuple(preload), True
    if restart:
        stop_template()
    _failed = None
    if not wait:
        with _guard:
            if _template is None:
                globals()["_template"] = Template(_preload)
        return 0.0
    handle = template()
    return time.monotonic() - handle.started


def warm_in_background() -> None:
    """Start this kernel's template without waiting for it, unless one runs or the last start
    failed (`warm_up` tries again): for the next launch or submit that can use it."""
    global _template
    with _guard:
        if _template is None and _failed is None:
            _template = Template(_preload)


def stop_template() -> None:
    """Stop this kernel's warm template now, rather than when the kernel ends.

    The ranks it forked stay until their launch ends or their live `Ranks` are closed. The next
    launch that needs a template starts a new one (or `warm_up` does).

    Returns
    -------
    None
    """
    global _template
    with _guard:
        if _template is not None:
            _template.close()
            _template = None
        while _unresponsive:
            _unresponsive.pop().close()


atexit.register(stop_template)
