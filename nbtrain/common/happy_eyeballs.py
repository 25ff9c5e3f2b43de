"""Several addresses of one service tried at once, staggered (RFC 8305's "happy eyeballs").

A notebook's machine may have several addresses, and one a node cannot reach may drop its
packets silently: tried in turn, it would cost its whole timeout before the next is tried.
Here each address gets a thread of its own, started `stagger` seconds after the one before
unless that one has already failed; the first to connect and pass `handshake` wins, and the
others are ended and joined before `first_to_answer` returns.
"""
from __future__ import annotations

import errno
import math
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

STAGGER_SECONDS = 0.25  # RFC 8305's recommended Connection Attempt Delay
SETTLE_SECONDS = 0.05  # answering this close together, the address given first wins
NOT_TRIED = "not tried"  # an address the race had no time left to try
_IN_PROGRESS = (errno.EINPROGRESS, errno.EWOULDBLOCK)  # a non-blocking connect under way

Address = tuple[str, int]


class NoneAnswered(ConnectionError):
    """No address passed: `reasons` holds each address's exception, in the order given."""

    def __init__(self, reasons: dict[Address, BaseException]):
        super().__init__(", ".join(f"{host}:{port} ({exc})" for (host, port), exc in reasons.items()))
        self.reasons = reasons

    def __reduce__(self):
        return type(self), (self.reasons,)


def first_to_answer(addresses: Sequence[Address], handshake: Callable[[socket.socket, float], object],
                    seconds: float, stagger: float = STAGGER_SECONDS, until: float = math.inf):
    """(index, result) of the first address to connect and pass `handshake(sock, seconds_left)`.

    `handshake` gets a connected, blocking socket and the seconds its attempt has left; it
    returns a result of its own (closed with `.close()` if it loses) or raises. Each attempt
    has `seconds` from its start; the whole race ends `seconds` after the last attempt could
    have started, or at `until` (a `time.monotonic()`) if sooner. When several pass within
    SETTLE_SECONDS, the one given first wins. Raises `NoneAnswered` with every address's reason
    when none passed.
    """
    stop_read, stop_write = socket.socketpair()  # one byte written ends every attempt's wait
    done: queue.Queue = queue.Queue()
    attempts: list[_Attempt] = []
    reasons: dict[int, BaseException] = {}
    winner, settle, heard = None, 0.0, set()
    deadline = min(time.monotonic() + seconds + stagger * (len(addresses) - 1), until)
    try:
        while len(reasons) < len(addresses):
            now = time.monotonic()
            if winner is not None:  # a better address already in its handshake gets a moment to finish
                if now >= settle or not any(a.connected and a.index not in heard for a in attempts[:winner[0]]):
                    break
                later = settle
            elif now >= deadline:
                break
            elif len(attempts) < len(addresses) and (not attempts or attempts[-1].index in reasons
                                                     or now >= attempts[-1].started + stagger):
                attempts.append(_Attempt(len(attempts), addresses[len(attempts)], handshake, seconds, stop_read, done))
                continue
            else:
                later = deadline if len(attempts) == len(addresses) else min(deadline, attempts[-1].started + stagger)
            try:
                index, result, error = done.get(timeout=max(0.0, later - now))
            except queue.Empty:
                continue
            heard.add(index)
            if error is not None:
                reasons[index] = error
            elif winner is None:
                winner, settle = (index, result), time.monotonic() + SETTLE_SECONDS
            elif index < winner[0]:
                _discard(winner[1])
                winner = (index, result)
            else:
                _discard(result)
    finally:
        stop_write.send(b"x")
        for attempt in attempts:
            attempt.cancel()
        for attempt in attempts:
            attempt.join()
        while not done.empty():  # answered as the race ended
            index, result, error = done.get_nowait()
            if error is not None:
                reasons.setdefault(index, error)
            elif winner is None or index < winner[0]:  # whole (see _Attempt.run), and better
                _discard(winner and winner[1])
                winner = (index, result)
            else:
                _discard(result)
        stop_read.close()
        stop_write.close()
    if winner is not None:
        return winner
    for index in range(len(addresses)):
        reasons.setdefault(index, TimeoutError(f"no answer within {seconds:.3g} s" if index < len(attempts)
                                               else f"{NOT_TRIED}: out of time"))
    raise NoneAnswered({addresses[i]: reasons[i] for i in range(len(addresses))})


def _discard(result) -> None:
    if result is not None:
        result.close()


class _Attempt(threading.Thread):
    """One address: resolve, connect (a non-blocking connect, so the race's stop ends its wait),
    then the handshake (ended by shutting the socket down, which wakes its blocking reads)."""

    def __init__(self, index: int, address: Address, handshake, seconds: float, stop, done: queue.Queue):
        super().__init__(name=f"nbtrain-dial-{address[0]}:{address[1]}", daemon=True)
        self.index, self.address, self.handshake, self.seconds = index, address, handshake, seconds
        self.stop, self.done = stop, done
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cancelled = self._connected = False
        self.start()

    @property
    def connected(self) -> bool:  # and stays so: its report, whatever it says, is still to be read
        return self._connected

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # not connected yet: the stop byte ends its wait
                    pass

    def run(self) -> None:
        deadline = self.started + self.seconds
        result = None
        error: BaseException | None = None
        try:
            sock = self._connect(deadline)
            try:
                result = self.handshake(sock, max(0.0, deadline - time.monotonic()))
            finally:
                with self._lock:
                    self._sock, shut = None, self._cancelled  # cancelled by now: the connection was shut down
                sock.close()
            if shut:  # its result shares the shut-down connection (a dup'd descriptor is the same socket)
                _discard(result)
                result, error = None, TimeoutError(f"no answer within {self.seconds:.3g} s")
        except Exception as exc:  # the reason this address failed, reported to the race
            # Ended by the race: out of time (had another won, no reason of this one is read).
            error = TimeoutError(f"no answer within {self.seconds:.3g} s") if self._cancelled else exc
        self.done.put((self.index, result, error))

    def _connect(self, deadline: float) -> socket.socket:
        host, port = self.address
        last: OSError = OSError(f"{host} resolved to no address")
        for family, kind, proto, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                code = sock.connect_ex(where)
                if code not in (0, *_IN_PROGRESS):
                    raise OSError(code, os.strerror(code))  # OSError picks the subclass: ConnectionRefusedError...
                with selectors.DefaultSelector() as selector:
                    selector.register(sock, selectors.EVENT_WRITE)
                    selector.register(self.stop, selectors.EVENT_READ)
                    ready = {key.fileobj for key, _ in selector.select(max(0.0, deadline - time.monotonic()))}
                if sock not in ready:  # out of time, or ended by the race
                    raise TimeoutError(f"no answer within {self.seconds:.3g} s")
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
                sock.setblocking(True)
                with self._lock:
                    if self._cancelled:
                        raise TimeoutError(f"no answer within {self.seconds:.3g} s")
                    self._sock, self._connected = sock, True
                return sock
            except OSError as exc:
                sock.close()
                last = exc
                if isinstance(exc, TimeoutError) or self._cancelled:
                    break
        raise last

