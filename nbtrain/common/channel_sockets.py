"""The channel's connections below multiprocessing's `Connection`: its framing written in chunks that
report progress, and the socket options both sides set on a connection from any thread."""
from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager

WRITE_CHUNK = 1 << 20


def send_bytes(conn, data, progress=None) -> None:
    """`Connection.send_bytes`'s framing (what `recv` reads), written in chunks that report progress."""
    size = len(data)
    header = struct.pack("!i", size) if size <= 0x7fffffff else struct.pack("!iQ", -1, size)
    fd = conn.fileno()
    if size <= 16384:  # one write, as Connection does
        _write_all(fd, memoryview(header + bytes(data)))
        return
    _write_all(fd, memoryview(header))
    view, sent = memoryview(data).cast("B"), 0
    while sent < size:
        sent += os.write(fd, view[sent:sent + WRITE_CHUNK])
        if progress is not None:
            progress(sent)


def _write_all(fd: int, view) -> None:
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


@contextmanager
def socket_of(conn) -> Iterator[socket.socket]:
    """The connection's own socket, borrowed for a call: its descriptor is not duplicated (at the
    open-file limit there is none to spare, and a rank's handshake must not need one) and stays the
    connection's."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        yield sock
    finally:
        sock.detach()


def no_delay(conn) -> None:
    """Send each message at once. With Nagle's algorithm a reply written right after another
    small message waits for the peer's delayed acknowledgement: ~40 ms per command round trip."""
    try:
        with socket_of(conn) as sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # the connection was closed already
        return


def shut(conn) -> None:
    """End a connection both ways from any thread: a thread blocked reading it wakes (a close would not)."""
    try:
        with socket_of(conn) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def receive_timeout(conn, seconds: float) -> None:
    """SO_RCVTIMEO on a connection's socket (0: none). Set on the socket itself, so the
    connection's own blocking reads honour it, unlike a timeout on a Python socket object."""
    with socket_of(conn) as sock:
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
