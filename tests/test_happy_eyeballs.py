"""A rank tries the notebook's addresses at once, staggered: an address that drops packets
silently (a network namespace that never answers, made here) does not hold up the one that
works; the best of several that answer wins; nothing is left open."""
import os
import queue
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from nbtrain.common.channel import Hub
from nbtrain.common.channel_dial import ADDRESS_VAR, AUTHKEY_VAR, ChannelUnreachable, dial
from nbtrain.common.happy_eyeballs import first_to_answer
from nbtrain.rank import remote_entry


def _dial_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbtrain-dial")]


@contextmanager
def silent_address():
    """An address whose packets go out and are never answered (no refusal, no ICMP): a network
    namespace reached over a veth pair, whose replies to this machine go to a blackhole route."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a silently dropping address needs root and `ip` (a network namespace)")
    pid = os.getpid()
    ns, outside, inside = f"nbt{pid % 100000}drop", f"nbt{pid % 100000}do", f"nbt{pid % 100000}di"
    subnet = f"10.233.{pid % 100 + 100}"

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        try:
            ip("netns", "add", ns)
            ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            ip("link", "set", inside, "netns", ns)
            ip("addr", "add", f"{subnet}.1/30", "dev", outside)
            ip("link", "set", outside, "up")
            ip("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "route", "add", "blackhole", f"{subnet}.1/32")  # no SYN-ACK, no RST comes back
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"could not make a silent address: `{' '.join(exc.cmd)}`: {exc.stderr.strip()}")
        yield f"{subnet}.2"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veth pair goes with it
        subprocess.run(["ip", "link", "del", outside], capture_output=True)


class _Pending:
    """A handshake's result: what it saw (first_to_answer closes the losers' results)."""

    def __init__(self, value: bool):
        self.value = value

    def close(self):
        pass


@pytest.fixture
def hub():
    hub = Hub(queue.Queue())
    hub.start()
    yield hub
    hub.close()


@pytest.mark.slow
def test_a_silent_address_listed_first_does_not_hold_up_the_one_that_answers(hub, no_leftovers):
    host, port = hub.environ[ADDRESS_VAR].rsplit(":", 1)
    key = bytes.fromhex(hub.environ[AUTHKEY_VAR])
    with silent_address() as silent:
        with pytest.raises(OSError, match="timed out"):  # it is silent: the kernel's own connect times out
            socket.create_connection((silent, int(port)), timeout=0.5).close()
        dial([(silent, int(port)), (host, int(port))], key, rank=4).close()
        # Not held up: the address that answers is tried while the silent one still waits (in
        # turn, it would be tried only after the silent one's 30 s). How long it takes:
        # benchmarks/dial_addresses.py.
        silent_attempt = f"nbtrain-dial-{silent}:{port}"

        def while_the_silent_one_waits(sock, left):
            return _Pending(any(t.name == silent_attempt and t.is_alive() for t in threading.enumerate()))

        index, pending = first_to_answer([(silent, int(port)), (host, int(port))], while_the_silent_one_waits, 30.0)
        assert index == 1 and pending.value, "the answering address was tried only after the silent one gave up"

        environ = {ADDRESS_VAR: f"{silent}:{port},{host}:{port}"}
        remote_entry.check_reachable(environ, 0)
        assert environ[ADDRESS_VAR] == f"{host}:{port},{silent}:{port}"  # the one that answered, first

        with socket.socket() as refused:
            refused.bind(("127.0.0.1", 0))  # bound, not listening
            refused_port = refused.getsockname()[1]
            with pytest.raises(ChannelUnreachable) as caught:
                dial([(silent, int(port)), ("127.0.0.1", refused_port)], key, rank=2, seconds=1.0)
        message = str(caught.value)  # none answered: each address with its reason
        assert f"{silent}:{port} (no answer within 1 s)" in message, message
        assert f"127.0.0.1:{refused_port} (Connection refused)" in message, message
    assert not _dial_threads()


def test_the_address_given_first_wins_when_several_answer():
    """Both answer before the race looks: the better one (given first) is kept, the other closed."""
    with socket.create_server(("127.0.0.1", 0)) as first, socket.create_server(("127.0.0.1", 0)) as second:
        answered = threading.Barrier(2)

        def handshake(sock, left):
            answered.wait(5)  # both connected and answered in the same moment
            return socket.socket(fileno=os.dup(sock.fileno()))

        index, sock = first_to_answer([first.getsockname(), second.getsockname()], handshake, 5.0, stagger=0.0)
        try:
            assert index == 0 and sock.getpeername() == first.getsockname()
            loser, _ = second.accept()
            with loser:
                loser.settimeout(5)
                assert loser.recv(1) == b""  # closed by the race
        finally:
            sock.close()
    assert not _dial_threads()


def test_an_address_that_fails_starts_the_next_at_once():
    """A refusal does not wait out the stagger: the next address is tried straight away. The
    stagger is an hour and the race ends within a minute: waited out, the live address would
    never be tried."""
    with socket.socket() as refused, socket.create_server(("127.0.0.1", 0)) as live:
        refused.bind(("127.0.0.1", 0))
        index, _ = first_to_answer([refused.getsockname(), live.getsockname()], lambda sock, left: None, 5.0,
                                   stagger=3600.0, until=time.monotonic() + 60)
        assert index == 1
    assert not _dial_threads()
