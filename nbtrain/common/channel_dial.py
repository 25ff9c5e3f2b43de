"""A rank's way to the notebook's channel: the environment that names it (`NBTRAIN_CHANNEL`'s
addresses, `NBTRAIN_AUTHKEY`, a forked rank's `NBTRAIN_CHANNEL_FD`) and `dial`: connect, then the
authkey challenge both ways, retried with back-off until CONNECT_SECONDS."""
from __future__ import annotations

import os
import random
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from .channel_sockets import no_delay, receive_timeout
from .happy_eyeballs import NOT_TRIED, NoneAnswered, first_to_answer

ADDRESS_VAR = "NBTRAIN_CHANNEL"
AUTHKEY_VAR = "NBTRAIN_AUTHKEY"
FD_VAR = "NBTRAIN_CHANNEL_FD"  # a forked rank's end of its socketpair; popped by its Link
CONNECT_SECONDS = 30.0  # a rank that cannot reach the notebook by then gives up and says why
HANDSHAKE_SECONDS = 5.0  # one attempt: connect and the authkey challenge, both ways


class ChannelUnreachable(ConnectionError):
    """A rank could not reach the notebook's channel in CONNECT_SECONDS."""


def addresses(value: str) -> list[tuple[str, int]]:
    """`NBTRAIN_CHANNEL`'s 'HOST:PORT[,HOST:PORT...]' as (host, port) pairs, in order."""
    pairs = []
    for item in value.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{ADDRESS_VAR}={value!r}: expected HOST:PORT, or several separated by commas")
        pairs.append((host, int(port)))
    return pairs


def dial(address, authkey: bytes, rank: int, seconds: float = CONNECT_SECONDS) -> Connection:
    """Connect to the Hub and pass the authkey challenge both ways, retrying with back-off.

    `address`: a (host, port), or a list of them, best first (a notebook's machine may have
    several addresses, not all reachable from every node; one may even reach another
    notebook's channel, whose key is not this one). Each round tries them all at once,
    staggered (`happy_eyeballs`): an address that drops packets silently costs a quarter of
    a second, not its whole timeout. Each attempt is bounded: a handshake the notebook lost
    (its accept queue was full) or a notebook too busy to answer is retried, never waited on
    forever.
    """
    candidates = [address] if isinstance(address, tuple) else list(address)
    deadline = time.monotonic() + seconds
    pause, attempts = 0.02, 0
    reasons: dict[tuple[str, int], str] = {}
    while True:
        attempts += 1
        limit = max(0.0, min(HANDSHAKE_SECONDS, deadline - time.monotonic()))
        try:
            return first_to_answer(candidates, lambda sock, left: _handshake(sock, authkey, left), limit,
                                   until=deadline)[1]
        except NoneAnswered as failed:
            for candidate, exc in failed.reasons.items():
                reason = _reason(exc)
                # A last round cut short by the deadline says less than the round before it.
                if candidate not in reasons or not reason.startswith(NOT_TRIED):
                    reasons[candidate] = reason
        if all(reason.startswith("refused this rank's authkey") for reason in reasons.values()):
            # A wrong key will not become right: say so now.
            raise ChannelUnreachable(f"rank {rank}: {_tried(reasons)}; NBTRAIN_AUTHKEY is not this launch's")
        if time.monotonic() + pause > deadline:
            raise ChannelUnreachable(
                f"rank {rank}: could not reach the notebook {_tried(reasons, f'{attempts} attempts in {seconds:g} s')} "
                f"from {socket.gethostname()}. The kernel may have exited, or this machine cannot reach that "
                f"address: for ranks on other machines give the notebook an address they can reach "
                f"(Slurm(notebook_address=...) / Ray(notebook_address=...)).")
        time.sleep(pause * random.uniform(0.5, 1.5))  # jittered, so retries do not arrive in step
        pause = min(pause * 2, 1.0)


def _tried(reasons: dict[tuple[str, int], str], attempts: str = "") -> str:
    """What was tried and why each failed: one address as before, several each with its reason."""
    if len(reasons) == 1:
        [((host, port), reason)] = reasons.items()
        if not attempts:
            return f"the notebook at {host}:{port} {reason}"
        return f"at {host}:{port} ({attempts}; last: {reason})"
    each = ", ".join(f"{host}:{port} ({reason})" for (host, port), reason in reasons.items())
    return f"at any of its addresses ({attempts}; tried {each})" if attempts else f"tried {each}"


def _handshake(sock: socket.socket, authkey: bytes, seconds: float) -> Connection:
    """The authkey challenge both ways on a connected socket, each read bounded by `seconds`.
    The connection has a descriptor of its own, so the race may close `sock` (a race that shuts
    `sock` down first ends this connection too: happy_eyeballs then discards it)."""
    conn = Connection(os.dup(sock.fileno()))
    try:
        receive_timeout(conn, max(seconds, 0.001))  # 0 would mean no limit
        try:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError(f"no answer within {seconds:.3g} s") from None
        receive_timeout(conn, 0.0)
        no_delay(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _reason(exc: BaseException) -> str:
    if isinstance(exc, AuthenticationError):
        return f"refused this rank's authkey ({exc})"
    if isinstance(exc, EOFError):
        return "the notebook closed the connection during the handshake"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)

