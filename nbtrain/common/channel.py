"""One two-way channel between the notebook and every rank, whatever started the rank.

The notebook side (`Hub`) listens with a random authkey — on 127.0.0.1 unless a remote
placement asks for another address — and ranks find it through `NBTRAIN_CHANNEL` (one
address, or several to try in order: `HOST:PORT,HOST:PORT`) / `NBTRAIN_AUTHKEY` in their
environment, so forked, spawned, template-forked, torchrun-,
SLURM- and Ray-started ranks speak the same protocol. The authkey is the security boundary:
a connection that fails its challenge is dropped before anything is read from it. A rank forked
from the kernel dials nothing: it inherits its end of a `socketpair` made for it alone
(`Hub.adopt`, `NBTRAIN_CHANNEL_FD`), a connection no other process can hold, so it has no
challenge to pass (a dial and a challenge cost 7.5 ms of its start).

Ranks -> notebook: `protocol` records, each naming its sender's rank, batched on a thread of
the rank's own so a slow notebook never slows a training step; replies (`protocol.URGENT`) are
flushed at once. Notebook -> rank: commands (`Hub.send`), read on a second thread of the rank.

This module is the notebook's side (`Hub`); a rank's side is `channel_link.Link`, the way it
finds and dials the notebook `channel_dial`, what both do to a connection's socket `channel_sockets`.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler

from . import protocol
from .channel_dial import ADDRESS_VAR, AUTHKEY_VAR, HANDSHAKE_SECONDS
from .channel_sockets import no_delay, receive_timeout, send_bytes, shut

log = logging.getLogger(__name__)

AUTH_SECONDS = 10.0  # a connection that has not proven the authkey by then is dropped
MAX_STRANGERS = 64  # connections not yet authenticated, at once: a new one drops the oldest
OUT_OF_FILES_PAUSE = 0.05  # between accepts that failed for want of a file descriptor
SWEEP_SECONDS = 1.0  # how often the accept loop looks for strangers past AUTH_SECONDS
# Every rank of a launch dials at once. Listener's default backlog is 1: the kernel then drops
# the other SYNs, and worse, the final ACK of a handshake it has no room for, leaving a rank
# that believes it is connected waiting forever for a challenge the notebook never sends. The
# kernel caps the backlog at net.core.somaxconn.
BACKLOG = 4096
SEND_STALL = 10.0  # after a Ctrl-C, how long a message being sent may make no progress before its link is cut


class Hub:
    """Notebook side: accepts rank connections, puts every message on `inbox`, sends commands.

    A closed connection is reported as `protocol.Closed(rank)` so the notebook knows that nothing
    more will come from that rank. `host` is the address to bind (loopback by default);
    `advertise` the address ranks are told to dial, when it differs (0.0.0.0 bound, say), or
    several, best first: each rank tries them in order until one passes the authkey challenge.
    """

    def __init__(self, inbox: queue.Queue, host: str = "127.0.0.1", advertise: str | list[str] | None = None):
        self.inbox = inbox
        self._authkey = os.urandom(32)
        # The challenge is run per connection (`_serve`), on a thread of its own: one stranger
        # that connects and stays silent must not hold up any rank's connection.
        self._socket = socket.create_server((host, 0), backlog=BACKLOG)
        self._socket.settimeout(SWEEP_SECONDS)  # the accept loop also drops strangers that took too long
        self._address = self._socket.getsockname()[:2]
        self._advertise = [advertise or host] if isinstance(advertise, (str, type(None))) else list(advertise)
        self._lock = threading.Lock()
        # Strangers are bounded: at most MAX_STRANGERS at once, each for AUTH_SECONDS in all; nothing
        # of a dropped one is kept. Only connections that proved the authkey stay (`_served`).
        # not yet authenticated: the time each must be done by, and the thread that serves it
        self._strangers: dict[Connection, tuple[float, threading.Thread]] = {}
        self._served: dict[Connection, threading.Thread] = {}
        self._accepting: threading.Thread | None = None
        self._refusals = 0  # connections that failed the challenge (the first is logged as a warning)
        # Why the last accept failed when it was the process's open-file limit (EMFILE, ENFILE): the
        # rank's connection then waits unserved; its launch says this, not the rank's "could not reach".
        self.out_of_files: OSError | None = None
        self._by_rank: dict[int, object] = {}
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._writes: queue.SimpleQueue | None = None  # the main thread's messages, for `_writer`
        self._writer: threading.Thread | None = None
        self._queueing = threading.Lock()  # a message is queued before the writer's end, or refused

    @property
    def environ(self) -> dict[str, str]:
        port = self._address[1]
        return {ADDRESS_VAR: ",".join(f"{host}:{port}" for host in self._advertise), AUTHKEY_VAR: self._authkey.hex()}

    def start(self) -> None:
        # Started only after the first ranks are forked, so no rank inherits another's
        # connection (which would keep that connection open after its own rank died).
        self._accepting = threading.Thread(target=self._accept_loop, name="nbtrain-hub", daemon=True)
        self._accepting.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            self._drop_late_strangers()
            try:
                sock, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # the listener was closed, or a connection failed before it was accepted
                if self._closed.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # it fails at once until a file is closed
                    self.out_of_files = exc
                    self._closed.wait(OUT_OF_FILES_PAUSE)
                continue
            self.out_of_files = None
            if self._closed.is_set():
                sock.close()
                return
            sock.settimeout(None)
            conn = Connection(sock.detach())
            self._make_room()
            thread = threading.Thread(target=self._serve, args=(conn,), name="nbtrain-hub-auth", daemon=True)
            with self._lock:
                self._strangers[conn] = (time.monotonic() + AUTH_SECONDS, thread)
            thread.start()

    def _make_room(self) -> None:
        """Below MAX_STRANGERS before a newcomer is listed: the one waiting longest is shut and its
        thread awaited (bounded), so that on a loaded machine the shut ones' threads, which have not
        run yet, cannot pile up behind the bound."""
        while True:
            with self._lock:
                if len(self._strangers) < MAX_STRANGERS:
                    return
                oldest = min(self._strangers, key=lambda conn: self._strangers[conn][0])
                shut(oldest)
                leaving = self._strangers[oldest][1]
            leaving.join(SWEEP_SECONDS)
            with self._lock:  # a thread that did not end in time is forgotten; it ends on its own
                self._strangers.pop(oldest, None)

    def _drop_late_strangers(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conn, (deadline, _) in self._strangers.items():
                if deadline < now:
                    shut(conn)  # its thread's read fails: it forgets the connection and ends

    def _serve(self, conn) -> None:
        passed = self._authenticate(conn)
        with self._lock:  # under the lock: a connection is shut by others only while listed
            listed = self._strangers.pop(conn, None) is not None  # not when it was made to leave
            if passed and listed and not self._closed.is_set():
                self._served[conn] = threading.current_thread()
            else:
                passed = False
        if not passed:
            conn.close()
            return
        self._keep(conn)

    def adopt(self, sock: socket.socket) -> None:
        """Serve `sock`, a connection made before its rank started: one end of a `socketpair`
        whose other end only the rank forked for it holds. Nothing listens for it and nobody
        else can reach it, so it is served as an authenticated connection."""
        conn = Connection(sock.detach())
        thread = threading.Thread(target=self._keep, args=(conn,), name="nbtrain-hub-adopted", daemon=True)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._served[conn] = thread
        thread.start()

    def _keep(self, conn) -> None:
        """Read an authenticated connection until it ends; then say that its rank is `Closed`."""
        rank = None
        try:
            rank = self._read_loop(conn)
        finally:
            with self._lock:
                self._served.pop(conn, None)
            conn.close()  # after it left `_served`: nobody shuts a closed (reusable) descriptor
            if rank is not None:
                self.inbox.put(protocol.Closed(rank))

    def _authenticate(self, conn) -> bool:
        """The authkey's challenge, both ways; nothing is unpickled from a peer before it passes."""
        try:
            receive_timeout(conn, AUTH_SECONDS)  # each read bounded; the whole by _drop_late_strangers
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            receive_timeout(conn, 0.0)
        except AuthenticationError as exc:
            self._refusals += 1
            if self._refusals == 1:  # a flood of them must not flood the notebook
                log.warning("channel: refused a connection that failed the authkey challenge (%s); later "
                            "refusals are not reported", exc)
            return False
        except (OSError, EOFError, ValueError) as exc:  # silent, gone, or not speaking the protocol
            log.debug("channel: dropped a connection: %s", exc)
            return False
        return True

    def _read_loop(self, conn) -> int | None:
        """Put what a rank sends on the inbox until its connection ends; the rank."""
        no_delay(conn)
        rank = None
        try:
            while True:
                batch = conn.recv()
                for message in batch:
                    if rank is None:
                        rank = message.rank
                        self._by_rank[rank] = conn
                    self.inbox.put(message)
        except (EOFError, OSError):
            pass
        except Exception:  # a message that does not unpickle: the link is of no more use
            log.exception("channel: rank %s sent a message that cannot be read; its link is closed", rank)
        finally:
            if rank is not None and self._by_rank.get(rank) is conn:
                del self._by_rank[rank]
        return rank

    def connected(self, rank: int) -> bool:
        return rank in self._by_rank

    def send(self, rank: int, message: tuple) -> bool:
        """Send a command to `rank`; False if it is not (or no longer) connected.

        A message goes whole or not at all: a rank that read half of one would wait forever for
        the rest, and take the next message's bytes for it. On the kernel's main thread, where
        Ctrl-C lands, the bytes are written by a thread of their own; an interrupt while they are
        written lets them finish, then raises `SendInterrupted`. A message that makes no progress
        for SEND_STALL s after that (the rank is stopped), or a second Ctrl-C, cuts the link
        instead: the rank sees the connection close, never half a message.
        """
        conn = self._by_rank.get(rank)
        if conn is None:
            return False
        data = ForkingPickler.dumps(message)  # an interrupt here has sent nothing
        if threading.current_thread() is not threading.main_thread():
            return self._write(conn, data)
        write = _Write(conn, data)
        if not self._queue(write):
            return False
        interrupt: KeyboardInterrupt | None = None
        interrupted_at = 0.0
        while not write.done.is_set():
            try:
                if interrupt is None:
                    write.done.wait()
                elif write.stalled(SEND_STALL, interrupted_at):
                    self.cut(rank, conn)
                    write.done.wait(HANDSHAKE_SECONDS)
                    raise SendInterrupted(rank, len(data), whole=False, why=f"no progress in {SEND_STALL:g} s")
                else:
                    write.done.wait(0.1)
            except SendInterrupted:
                raise
            except KeyboardInterrupt as exc:
                if interrupt is not None:  # twice: stop waiting for the message
                    self.cut(rank, conn)
                    write.done.wait(HANDSHAKE_SECONDS)
                    raise SendInterrupted(rank, len(data), whole=False, why="interrupted twice") from None
                interrupt, interrupted_at = exc, time.monotonic()
                log.warning("channel: interrupted while sending %d bytes to rank %d: finishing the message first",
                            len(data), rank)
        if interrupt is not None:
            raise SendInterrupted(rank, len(data), whole=write.ok, why="" if write.ok else "the rank went away")
        return write.ok

    def _queue(self, write: _Write) -> bool:
        """Give the main thread's message to the writer: one thread for the Hub's life, not one a
        message (a thread's start costs ~0.3 ms, twice a call on two ranks). False once closed."""
        with self._queueing:
            if self._closed.is_set():
                return False
            if self._writes is None:
                self._writes = queue.SimpleQueue()
                self._writer = threading.Thread(target=self._write_loop, args=(self._writes,), name="nbtrain-send",
                                                daemon=True)
                self._writer.start()
            self._writes.put(write)
        return True

    def _write_loop(self, writes: queue.SimpleQueue) -> None:
        while (write := writes.get()) is not None:
            write.run(self)

    def _write(self, conn, data: bytes | memoryview, progress=None) -> bool:
        try:
            with self._send_lock:
                send_bytes(conn, data, progress)
            return True
        except (OSError, ValueError):
            return False

    def cut(self, rank: int, conn=None) -> None:
        """End the connection to `rank` both ways: a write blocked on it fails, the rank sees it close."""
        conn = conn or self._by_rank.get(rank)
        if conn is not None:
            shut(conn)

    def close(self) -> None:
        self._closed.set()
        try:  # wake the accept loop now, rather than at its next timeout
            host, port = self._address
            socket.create_connection(("127.0.0.1" if host == "0.0.0.0" else host, port), timeout=1.0).close()
        except OSError:
            pass
        if self._accepting is not None:
            self._accepting.join(timeout=SWEEP_SECONDS + 1.0)
        self._socket.close()
        with self._lock:
            for conn in [*self._strangers, *self._served]:
                shut(conn)  # their threads see the end, close them and end
            served = list(self._served.values())
        for thread in served:
            thread.join(timeout=1.0)
        with self._queueing:  # after what was queued: those writes fail fast, the connections are shut
            if self._writes is not None:
                self._writes.put(None)
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(timeout=1.0)


class SendInterrupted(KeyboardInterrupt):
    """Ctrl-C while a message to `rank` was being written. `whole`: it was finished first (the
    rank has it); otherwise the link to that rank was cut (`why`) and the rank is lost."""

    def __init__(self, rank: int, size: int, whole: bool, why: str = ""):
        super().__init__(rank, size, whole, why)
        self.rank, self.size, self.whole, self.why = rank, size, whole, why


class _Write:
    """One message's bytes, written by the Hub's writer thread (Ctrl-C reaches only the main thread)."""

    def __init__(self, conn, data: bytes | memoryview):
        self.conn = conn
        self.data: bytes | memoryview | None = data
        self.done = threading.Event()
        self.ok = False
        self.sent, self._moved = 0, time.monotonic()

    def run(self, hub: Hub) -> None:
        try:
            self.ok = self.data is not None and hub._write(self.conn, self.data, self._progress)
        finally:
            self.data = None  # a 500 MB push is not kept by the writer
            self.done.set()

    def _progress(self, sent: int) -> None:
        self.sent, self._moved = sent, time.monotonic()

    def stalled(self, seconds: float, since: float) -> bool:
        """No byte written for `seconds`, counted from `since` at the earliest."""
        return time.monotonic() - max(self._moved, since) > seconds

