"""A forked rank's channel: a socketpair made before the fork, never a connection to the Hub's port.

Each rank holds its own end and nothing else of the launch's channels (a copy held elsewhere
would hide that rank's end from the notebook); its own processes see neither the end nor its
variable; a rank that dies is still seen to close.
"""
import os
import queue
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

import nbtrain
from nbtrain.common import protocol
from nbtrain.common.channel import Hub
from nbtrain.common.channel_dial import ADDRESS_VAR, FD_VAR, addresses

pytestmark = pytest.mark.slow

# What a process a rank starts holds: the channel's variable, and how many sockets.
PROBE = ("import os; links = [os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd') "
         "if os.path.exists(f'/proc/self/fd/{fd}')]; "
         f"print(os.environ.get({FD_VAR!r}), sum(link.startswith('socket:') for link in links))")


def how_the_rank_reaches_the_notebook():
    port = addresses(os.environ[ADDRESS_VAR])[0][1]
    me = psutil.Process()
    dialed = [c for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port]
    paired = [c for c in me.net_connections("unix") if c.fd >= 0]
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    return dialed, FD_VAR in os.environ, len(paired), child


def test_a_forked_rank_is_connected_before_it_starts_and_passes_nothing_on(no_leftovers):
    result = nbtrain.launch(how_the_rank_reaches_the_notebook, devices=2, accelerator="cpu", start="fork",
                            progress=False, timeout=120)
    for rank, (dialed, still_set, paired, child) in enumerate(result.values):
        assert dialed == [], f"rank {rank} dialed the notebook's port: {dialed}"
        assert not still_set, f"rank {rank} still has {FD_VAR} in its environment"
        assert paired >= 1, f"rank {rank} holds no unix socket: where is its channel?"
        assert child == ["None", "0"], f"a process rank {rank} started inherited the channel: {child}"


def sockets(pid="self") -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def sockets_held_by_two(kernel_pid, before):
    """The sockets this rank shares with the kernel, and with the other ranks, leaving out those
    the kernel held before the launch (inherited by every fork, and none of the launch's)."""
    import torch.distributed as dist

    ctx = nbtrain.context()
    ctx.barrier()
    mine = sockets() - before
    deadline = time.monotonic() + 10.0  # the kernel closes its copies of the ranks' ends right after the forks
    while (with_kernel := mine & sockets(kernel_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    with_others = mine & set().union(*(s for r, s in enumerate(everyone) if r != ctx.rank))
    ctx.barrier()
    return sorted(with_kernel), sorted(with_others)


def test_no_process_of_a_fork_launch_holds_another_ones_channel_end(no_leftovers):
    result = nbtrain.launch(sockets_held_by_two, os.getpid(), sockets(), devices=3, accelerator="cpu",
                            start="fork", progress=False, timeout=120)
    assert result.values == [([], [])] * 3, result.values


# A rank as `Link` sees it: its end of the pair named by the variable; it says hello, then waits.
RANK = """
import os, time
from nbtrain.common import protocol
from nbtrain.common.channel_dial import FD_VAR
from nbtrain.common.channel_link import Link
link = Link(7)
assert FD_VAR not in os.environ
link.emit(protocol.Hello(7, os.getpid(), "here"))
time.sleep(120)
"""


def _next(inbox: queue.Queue, kind):
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            message = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if isinstance(message, kind):
            return message
    raise AssertionError(f"no {kind.__name__} within 30 s")


def test_an_adopted_connection_reports_its_ranks_messages_and_its_end(no_leftovers):
    inbox: queue.Queue = queue.Queue()
    hub = Hub(inbox)
    ours, theirs = socket.socketpair()
    try:
        rank = subprocess.Popen([sys.executable, "-c", RANK], pass_fds=[theirs.fileno()],
                                env={**os.environ, FD_VAR: str(theirs.fileno())})
        theirs.close()
        hub.adopt(ours)
        try:
            hello = _next(inbox, protocol.Hello)
            assert (hello.rank, hello.pid) == (7, rank.pid) and hub.connected(7)
            assert hub.send(7, protocol.Stop())  # the way back works too
            os.kill(rank.pid, signal.SIGKILL)  # a rank that dies, with no word
            assert _next(inbox, protocol.Closed) == protocol.Closed(7)
            assert not hub.connected(7)
        finally:
            rank.kill()
            rank.wait()
    finally:
        ours.close()
        theirs.close()
        hub.close()
