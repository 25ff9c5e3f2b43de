"""A rank's end of the channel (`Link`): its records batched to the notebook on a thread of their
own, and the notebook's commands read on a second."""
from __future__ import annotations

import _thread
import os
import threading
from multiprocessing.connection import Connection

from . import protocol
from .channel_dial import ADDRESS_VAR, AUTHKEY_VAR, FD_VAR, addresses, dial

FLUSH_SECONDS = 0.1
BATCH_LIMIT = 512


class Link:
    """Rank side: a batched, ordered stream of messages to the notebook, and the commands back.

    `on_command(message)` is called on the link's receiving thread for every command; when the
    notebook goes away (its end of the connection closes: the kernel died or was killed)
    `on_lost()` is called there, which by default ends the rank: nobody is left to serve.
    """

    def __init__(self, rank: int, environ=os.environ, on_command=None, on_lost=None):
        self.rank = rank
        inherited = environ.pop(FD_VAR, None)  # gone before this rank's code starts a process
        if inherited is not None:  # forked with its connection made (`Hub.adopt`)
            self._conn = Connection(int(inherited))
        else:
            self._conn = dial(addresses(environ[ADDRESS_VAR]), bytes.fromhex(environ[AUTHKEY_VAR]), rank)
        self._pending: list[tuple] = []
        self._lock = threading.Condition()
        self._sending = threading.Lock()  # held while a batch is written: batches go out in the order taken
        self._closing = False
        self._urgent = False
        _beside(self._send_loop)
        if on_command is not None:
            self.listen(on_command, on_lost)

    @classmethod
    def from_environ(cls, rank: int, environ=os.environ, **kwargs) -> Link | None:
        return cls(rank, environ, **kwargs) if ADDRESS_VAR in environ else None

    def listen(self, on_command, on_lost=None) -> None:
        _beside(self._receive_loop, on_command, on_lost or _end_rank)

    def emit(self, message) -> None:
        """Send a `protocol` record (its `rank` this link's): in the next batch, or at once if urgent."""
        with self._lock:
            self._pending.append(message)
            if type(message) in protocol.URGENT or len(self._pending) >= BATCH_LIMIT:
                self._urgent = True
                self._lock.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or self._urgent, FLUSH_SECONDS)
                if self._closing:  # `close` sends what is left
                    return
                batch, self._pending, self._urgent = self._pending, [], False
                self._sending.acquire()  # before the next batch can be taken
            try:
                if batch and not self._send(batch):
                    return
            finally:
                self._sending.release()

    def _send(self, batch: list) -> bool:
        try:
            self._conn.send(batch)
            return True
        except (OSError, ValueError):  # the notebook went away; the rank is being stopped anyway
            return False

    def _receive_loop(self, on_command, on_lost) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    on_lost()
                return
            except (TypeError, ValueError):
                # This link's own `close` took the connection's handle between recv's check and its
                # read (multiprocessing then reads from None): the end asked for, not an error.
                if self._closing:
                    return
                raise
            on_command(message)

    def close(self, *final) -> None:
        """Send what is pending, then `final` messages, and wait until they are written: from
        this thread, after any batch the sending thread took before (which then ends)."""
        with self._lock:
            batch, self._pending = [*self._pending, *final], []
            self._closing = True
            self._lock.notify()
        with self._sending:
            if batch:
                self._send(batch)
            self._conn.close()


def _beside(target, *args) -> None:
    """Run `target(*args)` on a thread of its own, a daemon's, without waiting for it to start:
    `threading.Thread.start` waits until the new thread runs, ~0.6 ms a thread in a rank just
    forked (the link's two threads are on every rank's way to the user's code)."""
    _thread.start_new_thread(target, args)



def _end_rank() -> None:
    os._exit(1)

