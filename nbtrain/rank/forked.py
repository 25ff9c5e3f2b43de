"""A rank forked from the kernel (`placements/processes.py` forks it): its entry, run in the child."""
from __future__ import annotations

import os
import socket
import sys

from .loop import serve
from .process import become_rank


class DynamoNoticed:
    """In a forked rank of a kernel without torch._dynamo: when the rank imports it, the kernel
    is told (the shared page), and imports it before its next fork, so the ranks it forks then
    share it. A finder that finds nothing: the import goes on as it would."""

    def __init__(self, page):
        self.page = page

    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            self.page[0] = 1


def fork_main(first, live, env, stdout_fd, stderr_fd, inherited_fds, parent_pid, watcher, dynamo_page):
    """A forked rank, from the fork to its end: the kernel's descriptors it must not hold dropped, then
    the rank's loop; never returns."""
    for fd in inherited_fds:  # other ranks' pipe and channel ends: holding them would hide their EOF
        try:
            os.close(fd)
        except OSError:
            pass
    close_listening_sockets()
    if dynamo_page is not None:
        sys.meta_path.insert(0, DynamoNoticed(dynamo_page))
    become_rank(parent_pid, env, stdout_fd, stderr_fd, forked=True, watcher=watcher)

    os._exit(serve(first, once=not live, live=live, exits=True))


def close_listening_sockets() -> None:
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


def quiet_stdin() -> None:
    """A rank reads nothing from the kernel's stdin: an `input()` there reads end-of-file at once."""
    try:
        sys.stdin = open(os.devnull, encoding="utf-8")  # the process's stdin for its life
    except OSError:
        pass
