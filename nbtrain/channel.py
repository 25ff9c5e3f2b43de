"""One channel from every rank to the notebook, whatever started the rank.

The notebook side (`Hub`) listens on 127.0.0.1 with a random authkey; ranks find it through
`NBTRAIN_CHANNEL` / `NBTRAIN_AUTHKEY` in their environment, so forked, spawned and
torchrun-started ranks speak the same protocol. Every message is a tuple whose first item
is its kind and second the sender's rank. Ranks batch their events on a thread of their own,
so a slow notebook never slows a training step.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from multiprocessing.connection import Client, Listener

log = logging.getLogger(__name__)

ADDRESS_VAR = "NBTRAIN_CHANNEL"
AUTHKEY_VAR = "NBTRAIN_AUTHKEY"
FLUSH_SECONDS = 0.1
BATCH_LIMIT = 512


class Hub:
    """Notebook side: accepts rank connections and puts every message on `inbox`.

    A closed connection is reported as ("closed", rank) so the supervisor knows that
    nothing more will come from that rank.
    """

    def __init__(self, inbox: queue.Queue):
        self.inbox = inbox
        self._authkey = os.urandom(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._threads: list[threading.Thread] = []
        self._connections = []
        self._closed = threading.Event()

    @property
    def environ(self) -> dict[str, str]:
        host, port = self._listener.address
        return {ADDRESS_VAR: f"{host}:{port}", AUTHKEY_VAR: self._authkey.hex()}

    def start(self) -> None:
        # Started only after every rank is forked, so no rank inherits another's connection
        # (which would keep that connection open after its own rank died).
        self._spawn(self._accept_loop)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="nbtrain-hub", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # closed listener, or a stranger failing the authkey challenge
                if self._closed.is_set():
                    return
                continue
            self._connections.append(conn)
            self._spawn(self._read_loop, conn)

    def _read_loop(self, conn) -> None:
        rank = None
        try:
            while True:
                batch = conn.recv()
                for message in batch:
                    rank = message[1]
                    self.inbox.put(message)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            if rank is not None:
                self.inbox.put(("closed", rank))

    def close(self) -> None:
        self._closed.set()
        try:  # closing a listening socket does not wake a thread blocked in accept(); a connection does
            socket.create_connection(self._listener.address, timeout=1.0).close()
        except OSError:
            pass
        self._listener.close()
        for conn in list(self._connections):
            try:
                conn.close()
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=1.0)


class Link:
    """Rank side: a batched, ordered stream of messages to the notebook."""

    def __init__(self, rank: int, environ=os.environ):
        host, port = environ[ADDRESS_VAR].rsplit(":", 1)
        self.rank = rank
        self._conn = Client((host, int(port)), authkey=bytes.fromhex(environ[AUTHKEY_VAR]))
        self._pending: list[tuple] = []
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._send_loop, name="nbtrain-link", daemon=True)
        self._thread.start()

    @classmethod
    def from_environ(cls, rank: int, environ=os.environ) -> "Link | None":
        return cls(rank, environ) if ADDRESS_VAR in environ else None

    def emit(self, kind: str, *payload) -> None:
        with self._lock:
            self._pending.append((kind, self.rank, *payload))
            if len(self._pending) >= BATCH_LIMIT:
                self._lock.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or len(self._pending) >= BATCH_LIMIT, FLUSH_SECONDS)
                batch, self._pending = self._pending, []
                closing = self._closing
            if batch:
                try:
                    self._conn.send(batch)
                except OSError:  # the notebook went away; the rank is being stopped anyway
                    return
            if closing:
                return

    def close(self, *final: tuple) -> None:
        """Send what is pending, then `final` messages, and wait until they are written."""
        with self._lock:
            self._pending.extend((kind, self.rank, *payload) for kind, *payload in final)
            self._closing = True
            self._lock.notify()
        self._thread.join()
        self._conn.close()


class OutputPump:
    """Reads ranks' stdout/stderr pipes on one thread and puts ("output", rank, stream, line)
    on the inbox; `rank_of` may map a line to its rank (torchrun prefixes lines with it)."""

    def __init__(self, inbox: queue.Queue):
        import selectors

        self.inbox = inbox
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, fd: int, rank: int | None, stream: str, rank_of=None) -> None:
        import selectors

        os.set_blocking(fd, False)
        self._selector.register(fd, selectors.EVENT_READ, (rank, stream, rank_of))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nbtrain-output", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._selector.get_map() and not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                self._read(key)

    def _read(self, key) -> None:
        fd, (rank, stream, rank_of) = key.fd, key.data
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data = self._partial.pop(fd, b"") + chunk
        lines = data.split(b"\n")
        if chunk:
            self._partial[fd] = lines.pop()
        else:  # end of file: the last partial line is still output
            self._selector.unregister(fd)
            os.close(fd)
            lines = [line for line in lines if line]
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            who, text = rank_of(text) if rank_of else (rank, text)
            self.inbox.put(("output", who, stream, text))

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until every pipe reached end of file."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            os.close(key.fd)
        self._selector.close()
