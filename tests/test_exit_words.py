"""The words a rank's end is told in (`describe_exit`), and the one rendezvous address a user
types (`parse_endpoint`): pure functions, read here as the user reads them."""
import pytest

from nbtrain.placements.base import describe_exit
from nbtrain.placements.script import parse_endpoint


@pytest.mark.parametrize("code, pid, words", [
    (3, 4242, "exited with code 3 (PID 4242)"),
    (3, None, "exited with code 3"),
    (0, 4242, "exited before reporting a result (PID 4242)"),  # a rank that returns reports first
    (-9, 4242, "Signal 9 (SIGKILL) received by PID 4242 — killed, often by the out-of-memory killer"),
    (-11, 4242, "Signal 11 (SIGSEGV) received by PID 4242"),
    (-15, 4242, "Signal 15 (SIGTERM) received by PID 4242"),
    (-200, 4242, "Signal 200 (unknown) received by PID 4242"),
])
def test_a_rank_s_end_in_words(code, pid, words):
    assert describe_exit(code, pid) == words


@pytest.mark.parametrize("endpoint, parsed", [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)),
    ("node-1.cluster:1", ("node-1.cluster", 1)),
    ("[fe80::1]:29400", ("fe80::1", 29400)),  # IPv6 in brackets, as torchrun takes it
    ("fe80::1:29400", ("fe80::1", 29400)),
])
def test_an_endpoint_is_a_host_and_a_port(endpoint, parsed):
    assert parse_endpoint(endpoint) == parsed


@pytest.mark.parametrize("endpoint", ["nohost", ":29400", "host:", "host:http", "host:0", "host:65536", 29400])
def test_a_bad_endpoint_says_what_to_give(endpoint):
    with pytest.raises(ValueError) as caught:
        parse_endpoint(endpoint)
    assert str(caught.value) == (f"rdzv_endpoint={endpoint!r}: give HOST:PORT, node 0's address and a free port on "
                                 "it (the same on every node), e.g. '10.0.0.1:29400'.")
