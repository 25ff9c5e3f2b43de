"""One watcher for all the ranks a kernel starts as its own children (forked or spawned).

`watcher.py --kernel`, started at the kernel's first such launch and kept for its life, holds a
pidfd of the kernel and a datagram socket bound in a new 0700 directory (`address`). Each rank
sends it a pidfd of itself as it starts (`register`); the watcher forgets a rank once it ends,
and once the kernel ends it stops every rank still running, ends their trees and kills them, as
a rank's own watcher does (`process_tree`), then exits. Against a watcher per rank: no
interpreter started per rank per launch (~10 ms of CPU each on a launch's critical path), and a
rank drops its parent-death signal as soon as its send returns, waiting for nothing.

A process forked from the kernel (a rank, or the user's own `os.fork`) inherits this module's
record of it but is not its owner (`_started["owner"]`): a launch of its own starts its own.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
import threading

from .leftovers import remove_orphans
from .process_tree import spawn_watcher

_DIR = re.compile(r"nbtrain-watch-(\d+)-\w+")  # named for the kernel: a killed one's is removed later
REGISTER_TIMEOUT = 5.0  # seconds a rank waits for room in the queue of a watcher that does not read
_started: dict = {}  # "owner": the pid of the process that started it, "address"
_lock = threading.Lock()  # a sweep's slots launch from threads


def address() -> str | None:
    """Where this process's ranks register with its watcher (`register`), started now if it has
    none running; None where none can start (no pidfd or posix_spawn, a temporary directory whose
    path is too long for a socket): its ranks start watchers of their own."""
    with _lock:
        if _started.get("owner") == os.getpid():
            if _listening(_started["address"]):
                return _started["address"]
            shutil.rmtree(os.path.dirname(_started["address"]), ignore_errors=True)  # killed: its directory stayed
        _started.clear()  # it ended, or it is the watcher of a process this one is a fork of
        started = _start()
        if started:
            _started.update(owner=os.getpid(), address=started)
        return started


def remove_own() -> None:
    """Remove the directory of the watcher this process started. For a subreaper that ends its
    descendants as it ends (a submitted run's supervisor): the watcher is one of them, and ended
    so, it never gets to remove the directory itself."""
    with _lock:
        if _started.get("owner") == os.getpid():
            shutil.rmtree(os.path.dirname(_started["address"]), ignore_errors=True)
        _started.clear()


def _listening(address: str) -> bool:
    """Whether a process still holds the socket bound at `address` (a connect is refused once none does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(address)
        except OSError:
            return False
    return True


def _start() -> str | None:
    remove_orphans(tempfile.gettempdir(), _DIR, lambda path: shutil.rmtree(path, ignore_errors=True))
    directory = tempfile.mkdtemp(prefix=f"nbtrain-watch-{os.getpid()}-")  # a new name, 0700
    address = os.path.join(directory, "ranks")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    kernel = -1
    try:
        sock.bind(address)  # here, before any rank sends: what they send waits in its queue
        kernel = os.pidfd_open(os.getpid())
        pid = spawn_watcher(["--kernel", str(os.getpid()), str(kernel), str(sock.fileno())],
                            [kernel, sock.fileno()], setsid=True)
    except (OSError, AttributeError):
        shutil.rmtree(directory, ignore_errors=True)
        return None
    finally:
        sock.close()
        if kernel >= 0:
            os.close(kernel)
    # It forks and exits at once (the watcher goes on in its child, no child of the kernel's): reaped
    # off the launch's path.
    threading.Thread(target=os.waitpid, args=(pid, 0), name="nbtrain-watcher-start", daemon=True).start()
    return address


def register(address: str) -> bool:
    """Send a pidfd of this process to the watcher at `address`; whether it went (it then waits in
    the watcher's queue, which the watcher reads whole before it acts on the kernel's end)."""
    try:
        me = os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(REGISTER_TIMEOUT)
            sock.sendmsg([b"rank"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, me.to_bytes(4, sys.byteorder))], 0,
                         address)
        return True
    except OSError:  # no watcher holds the socket now, or it is stopped and its queue full
        return False
    finally:
        os.close(me)
