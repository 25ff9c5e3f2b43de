"""What the cluster placements share, without an engine: the channel's guard against strangers,
the address ranks dial, settings refused before anything starts, a missing engine named by its extra."""
import os
import queue
import socket
import sys

import psutil
import pytest

import nbtrain
from nbtrain.common.channel import Hub
from nbtrain.common.channel_dial import ADDRESS_VAR, AUTHKEY_VAR, ChannelUnreachable
from nbtrain.common.channel_link import Link
from nbtrain.common.protocol import Closed, Hello
from nbtrain.placements.clusters import base
from nbtrain.rank import remote_entry


@pytest.fixture
def hub():
    inbox = queue.Queue()
    hub = Hub(inbox)
    hub.start()
    yield hub, inbox
    hub.close()


def dial(hub):
    host, port = hub.environ[ADDRESS_VAR].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_a_silent_stranger_does_not_hold_up_the_ranks(hub):
    hub, inbox = hub
    strangers = [dial(hub) for _ in range(3)]  # connect, and never answer the challenge
    try:
        link = Link(0, hub.environ)
        link.emit(Hello(0, os.getpid()))
        assert inbox.get(timeout=10) == Hello(0, os.getpid())
        link.close()
    finally:
        for s in strangers:
            s.close()


def test_a_wrong_authkey_is_refused_and_nothing_it_sends_is_heard(hub):
    hub, inbox = hub
    with pytest.raises(ChannelUnreachable, match="refused this rank's authkey"):
        Link(0, {**hub.environ, AUTHKEY_VAR: os.urandom(32).hex()})
    garbage = dial(hub)
    garbage.sendall(b"\x00\x00\x00\x10" + b"not a challenge!")
    garbage.close()
    link = Link(1, hub.environ)
    link.emit(Hello(1, 1))
    assert inbox.get(timeout=10) == Hello(1, 1)
    link.close()
    assert inbox.empty() or isinstance(inbox.get(timeout=1), Closed)


def test_a_flood_of_strangers_is_bounded_forgotten_and_never_delays_a_rank(hub, monkeypatch):
    import threading
    import time

    from nbtrain.common import channel

    monkeypatch.setattr(channel, "AUTH_SECONDS", 2.0)  # how long a silent stranger is kept (10 s by default)
    hub, inbox = hub
    threads = threading.active_count()
    silent = [dial(hub) for _ in range(300)]  # connect, and never answer the challenge
    for _ in range(1000):  # connect and leave at once
        dial(hub).close()
    link = Link(0, hub.environ)  # a rank, in the middle of it
    link.emit(Hello(0, os.getpid()))
    # No queue of strangers ahead of it: behind the 64 held, each kept 2 s, it would wait two minutes.
    assert inbox.get(timeout=30) == Hello(0, os.getpid())
    assert len(hub._strangers) <= channel.MAX_STRANGERS  # bounded: the oldest made room for the newest
    assert threading.active_count() <= threads + channel.MAX_STRANGERS + 10
    deadline = time.monotonic() + 30
    while (hub._strangers or threading.active_count() > threads + 5) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not hub._strangers and list(hub._served) == [hub._by_rank[0]]  # nothing of them kept
    assert threading.active_count() <= threads + 5  # the rank's reader and the link's own threads
    for stranger in silent:  # each was dropped: after the challenge it was sent, its connection ends
        stranger.settimeout(5)  # (a socket.timeout here: the hub still holds it)
        while stranger.recv(65536):
            pass
        stranger.close()
    link.close()


def this_machines_address():
    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)


def test_the_channel_listens_where_the_nodes_are_told_to_dial():
    def default():
        return "127.0.0.1", "127.0.0.1"

    assert base.channel_options(None, default) == {"host": "127.0.0.1", "advertise": "127.0.0.1"}
    # Not an address of this machine (a name the nodes resolve, a forwarded port): every interface.
    assert base.channel_options("login.example.invalid", default) == {
        "host": "0.0.0.0", "advertise": "login.example.invalid"}
    assert base.channel_options("0.0.0.0", default) == {"host": "0.0.0.0", "advertise": base.notebook_addresses()}
    # A name may resolve here to loopback, which the nodes cannot use: every interface, the name advertised.
    assert base.channel_options("localhost", default) == {"host": "0.0.0.0", "advertise": "localhost"}
    address = this_machines_address()
    if address is not None:  # one of this machine's own addresses is bound, and only it
        assert base.channel_options(address, default) == {"host": address, "advertise": address}


@pytest.fixture
def private_address():
    """A private address on an interface the test creates (and removes): an address of this
    machine that is not loopback, as a node would reach the notebook by. A bridge with no ports,
    not a dummy interface: some kernels (gVisor's) have no dummy device type."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network interface of its own needs root and iproute2's `ip`")
    nic, address = f"nbt{os.getpid() % 100000}a", f"10.231.{200 + os.getpid() % 50}.1"
    made = subprocess.run(f"ip link add {nic} type bridge && ip addr add {address}/32 dev {nic} && "
                          f"ip link set {nic} up",
                          shell=True, capture_output=True, text=True)
    try:
        if made.returncode != 0:
            pytest.skip(f"could not create a bridge interface: {made.stderr.strip()}")
        yield address
    finally:
        subprocess.run(["ip", "link", "del", nic], capture_output=True)


@pytest.mark.slow  # `ip` makes the interface
def test_the_nodes_are_offered_every_address_of_this_machine_loopback_last(private_address):
    offered = base.notebook_addresses(toward=(private_address,))
    assert offered[0] == private_address  # the one toward the cluster first
    assert offered[-1] == "127.0.0.1" and not any(a.startswith("127.") for a in offered[:-1]), offered
    name = socket.gethostname()
    assert (name in offered) == any(not a.startswith("127.") for a in base._resolve(name))


@pytest.mark.slow  # `ip` makes the interface
def test_a_rank_tries_the_notebook_s_addresses_in_order_until_one_passes_the_challenge(private_address):
    """The first address is dead, the second is another notebook's channel (the wrong key: a
    node's own loopback may reach one), the third is this launch's, on a non-loopback address."""
    inbox, other = queue.Queue(), queue.Queue()
    hub, stranger = Hub(inbox, host=private_address), Hub(other)
    hub.start()
    stranger.start()
    try:
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))  # bound, not listening: refused
            port = hub.environ[ADDRESS_VAR].rsplit(":", 1)[1]
            environ = {**hub.environ, ADDRESS_VAR: f"127.0.0.1:{dead.getsockname()[1]},"
                                                   f"{stranger.environ[ADDRESS_VAR]},{private_address}:{port}"}
            link = Link(3, environ)
        link.emit(Hello(3, os.getpid()))
        assert inbox.get(timeout=10) == Hello(3, os.getpid())
        link.close()
        assert other.empty()  # the other notebook heard nothing from it
    finally:
        hub.close()
        stranger.close()


def test_a_rank_that_reaches_none_of_the_addresses_lists_each_with_its_reason():
    from nbtrain.common.channel_dial import dial

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        tried = [("127.0.0.1", a.getsockname()[1]), ("127.0.0.1", b.getsockname()[1])]
        with pytest.raises(ChannelUnreachable) as caught:
            dial(tried, os.urandom(32), rank=2, seconds=1.0)
        message = str(caught.value)
        assert message.startswith("rank 2: could not reach the notebook at any of its addresses"), message
        for host, port in tried:
            assert f"{host}:{port} (Connection refused)" in message, message
        assert f"from {socket.gethostname()}" in message and "notebook_address=" in message
        environ = {ADDRESS_VAR: ",".join(f"{h}:{p}" for h, p in tried)}
        with pytest.raises(ConnectionError) as caught:
            remote_entry.check_reachable(environ, 1)
        message = str(caught.value)
        assert f"rank 1 on {socket.gethostname()} cannot reach the notebook's channel at any of" in message, message
        assert all(f"127.0.0.1:{port} (ConnectionRefusedError" in message for _, port in tried), message


def test_a_node_dials_first_the_address_it_can_connect_to():
    with socket.socket() as dead, socket.create_server(("127.0.0.1", 0)) as live:
        dead.bind(("127.0.0.1", 0))
        dead_at, live_at = f"127.0.0.1:{dead.getsockname()[1]}", f"127.0.0.1:{live.getsockname()[1]}"
        environ = {ADDRESS_VAR: f"nbtrain-test.invalid:1,{dead_at},{live_at}"}
        remote_entry.check_reachable(environ, 0)
    assert environ[ADDRESS_VAR] == f"{live_at},nbtrain-test.invalid:1,{dead_at}"


def test_a_rank_on_another_machine_returns_bytes_not_shared_memory(tmp_path):
    environ = {remote_entry.MACHINE_VAR: "elsewhere/boot/0:0", remote_entry.PATH_VAR: str(tmp_path), remote_entry.CWD_VAR: os.getcwd()}
    cwd, path = os.getcwd(), list(sys.path)
    try:
        assert remote_entry.here(environ)[remote_entry.SHARED_MEMORY_VAR] == "0"
        assert str(tmp_path) in sys.path
        assert remote_entry.SHARED_MEMORY_VAR not in remote_entry.here({remote_entry.MACHINE_VAR: remote_entry.machine_identity()})
    finally:
        os.chdir(cwd)
        sys.path[:] = path


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="sbatch option 'ntasks_per_node' is nbtrain's to set"):
        nbtrain.Slurm(ntasks_per_node=4)
    with pytest.raises(ValueError, match="time=0: give minutes"):
        nbtrain.Slurm(time=0)
    with pytest.raises(ValueError, match=r"num_nodes=2 but Slurm\(nodes=3\)"):
        nbtrain.launch(print, cluster=nbtrain.Slurm(nodes=3), num_nodes=2)
    with pytest.raises(ValueError, match=r"devices=\[0, 1\]: on a cluster give a count of ranks"):
        nbtrain.launch(print, cluster=nbtrain.Slurm(), devices=[0, 1])
    with pytest.raises(ValueError, match=r"strategy='ddp_fork' \(start='fork'\) with cluster=Slurm\(\): the cluster's engine starts the ranks"):
        nbtrain.launch(print, cluster=nbtrain.Slurm(), strategy="ddp_fork")
    with pytest.raises(TypeError, match="give nbtrain.Slurm"):
        nbtrain.launch(print, cluster="slurm")
    with pytest.raises(ValueError, match="notebook_address=''"):
        nbtrain.Ray(notebook_address="")
    with pytest.raises(ValueError, match="num_workers=0: give an int >= 1"):
        nbtrain.Ray(num_workers=0)
    with pytest.raises(ValueError, match="each rank drives one GPU"):
        nbtrain.Ray(resources_per_worker={"GPU": 2})
    with pytest.raises(ValueError, match=r"devices=3 x num_nodes=1 is not Ray\(num_workers=2\)"):
        nbtrain.launch(print, cluster=nbtrain.Ray(num_workers=2), devices=3)
    with pytest.raises(ValueError, match=r"accelerator='gpu' on Ray needs Ray\(use_gpu=True\)"):
        nbtrain.launch(print, cluster=nbtrain.Ray(), accelerator="gpu")
    with pytest.raises(ValueError, match="start='fork' with cluster="):
        nbtrain.Ranks(cluster=nbtrain.Ray(), start="fork")


def test_queue_timeout_takes_seconds():
    for bad in (0, -1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ValueError, match="queue_timeout=.*: give the seconds a job may wait in SLURM's queue"):
            nbtrain.Slurm(queue_timeout=bad)
    assert nbtrain.Slurm(queue_timeout=600).queue_timeout == 600
    assert "queue_timeout=600" in repr(nbtrain.Slurm(queue_timeout=600))


def test_pending_reasons_that_waiting_cannot_clear_are_told_apart():
    from nbtrain.placements.clusters.slurm_words import never_runs

    def anything_exists(name):
        return True

    assert "configured to give" in never_runs("PartitionConfig", anything_exists)
    assert "more nodes than its partition allows" in never_runs("PartitionNodeLimit", anything_exists)
    assert "time limit is longer than its partition allows" in never_runs("PartitionTimeLimit", anything_exists)
    for waits in ("Resources", "Priority", "JobHeldUser", "AssocGrpCpuLimit", "None", "", "BeginTime"):
        assert never_runs(waits, anything_exists) is None, waits


def test_the_plan_says_where_the_ranks_run():
    plan = nbtrain.Slurm(partition="gpu", gpus_per_node=4).plan("auto", "auto", None, 2)
    assert (plan.accelerator, plan.nprocs, plan.num_nodes, plan.world_size, plan.backend) == ("gpu", 4, 2, 8, "nccl")
    assert plan.describe() == "4 GPU ranks per node x 2 nodes, nccl, on SLURM (partition gpu)"
    assert nbtrain.Ray(num_workers=3).plan("auto", "auto", None, 1).describe() == "3 CPU ranks, gloo, on Ray"
    job = nbtrain.placements.clusters.ClusterJob(print, (), {}, plan, "ddp")
    assert job.ranks == list(range(8)), "the notebook drives every node's ranks"


@pytest.mark.parametrize("engine, extra", [("submitit", "slurm"), ("ray", "ray")])
def test_a_missing_engine_is_named_with_the_extra_that_installs_it(monkeypatch, engine, extra, no_leftovers):
    monkeypatch.setitem(sys.modules, engine, None)  # what `import` does when the package is absent
    cluster = nbtrain.Slurm() if extra == "slurm" else nbtrain.Ray()
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'nbtrain\[{extra}\]'"):
        nbtrain.launch(print, cluster=cluster, progress=False)


def test_cell_options_for_clusters_are_checked():
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError

    from nbtrain.notebook.ipython.magics import DEFAULTS, make_cluster

    slurm = make_cluster({**DEFAULTS, "cluster": "slurm", "partition": "gpu", "time": "90",
                          "sbatch": ["qos=high", "exclusive"]})
    assert (slurm.partition, slurm.time, slurm.sbatch_options) == ("gpu", 90, {"qos": "high", "exclusive": True})
    assert make_cluster({**DEFAULTS, "cluster": "ray", "num_workers": 3}).num_workers == 3
    assert make_cluster(DEFAULTS) is None
    with pytest.raises(UsageError, match="--partition do not apply with no --cluster"):
        make_cluster({**DEFAULTS, "partition": "gpu"})
    with pytest.raises(UsageError, match="--num-workers do not apply with --cluster slurm"):
        make_cluster({**DEFAULTS, "cluster": "slurm", "num_workers": 2})
    with pytest.raises(UsageError, match="--launcher apply to ranks started on this machine"):
        make_cluster({**DEFAULTS, "cluster": "ray", "launcher": "accelerate"})
    with pytest.raises(UsageError, match="--strategy ddp_fork apply to ranks started on this machine"):
        make_cluster({**DEFAULTS, "cluster": "ray", "strategy": "ddp_fork"})


def test_a_node_without_the_notebook_s_directory_says_so_once(tmp_path):
    from nbtrain.rank.loop import NOTICE_VAR

    missing = str(tmp_path / "not-on-this-node")
    cwd, path = os.getcwd(), list(sys.path)
    try:
        first = remote_entry.here({remote_entry.CWD_VAR: missing, remote_entry.PATH_VAR: missing, "LOCAL_RANK": "0"})
        assert first[NOTICE_VAR].startswith(f"the notebook's directory {missing} is not on {socket.gethostname()}")
        assert os.getcwd() == cwd and missing not in sys.path
        assert NOTICE_VAR not in remote_entry.here({remote_entry.CWD_VAR: missing, "LOCAL_RANK": "1"})  # once per node
        assert NOTICE_VAR not in remote_entry.here({remote_entry.CWD_VAR: str(tmp_path), "LOCAL_RANK": "0"})
        assert os.getcwd() == str(tmp_path)
    finally:
        os.chdir(cwd)
        sys.path[:] = path


def test_live_ranks_on_several_nodes_need_a_cluster():
    for bad in (2, 0, "2"):
        with pytest.raises(ValueError, match=r"num_nodes=.*: give an int >= 1; more than one node needs a cluster"):
            nbtrain.Ranks(devices=1, num_nodes=bad)


class _RayStartingLate:
    """Stands in for the `ray` module's start (only its init and shutdown): its first starts fail
    as Ray's do on a loaded machine, a node that missed Ray's fixed 30 s to register."""

    def __init__(self, failures: int, words: str = "The current node timed out during startup. This could happen "
                 "because some of the raylet failed to startup or the GCS has become overloaded."):
        self.failures, self.words, self.calls = failures, words, []

    def init(self, address=None):
        self.calls.append(("init", address))
        if len([c for c in self.calls if c[0] == "init"]) <= self.failures:
            raise Exception(self.words)

    def shutdown(self):
        self.calls.append(("shutdown", None))


def test_a_local_ray_whose_start_timed_out_is_shut_down_and_started_again_twice_at_most(capsys):
    from nbtrain.placements.clusters.ray import _init

    once = _RayStartingLate(failures=1)
    _init(once, None)
    assert once.calls == [("init", None), ("shutdown", None), ("init", None)]
    assert "Ray's local start timed out" in capsys.readouterr().err
    twice = _RayStartingLate(failures=2)
    _init(twice, None)
    assert [c[0] for c in twice.calls] == ["init", "shutdown", "init", "shutdown", "init"]
    thrice = _RayStartingLate(failures=3)
    with pytest.raises(Exception, match="timed out during startup"):
        _init(thrice, None)  # said, not tried forever
    joining = _RayStartingLate(failures=1)
    with pytest.raises(Exception, match="timed out during startup"):
        _init(joining, "10.0.0.1:6379")  # a cluster the user named: its failure is theirs to see at once
    assert joining.calls == [("init", "10.0.0.1:6379")]
    other = _RayStartingLate(failures=1, words="ValueError: num_cpus must be positive")
    with pytest.raises(Exception, match="num_cpus"):
        _init(other, None)
    assert other.calls == [("init", None)]


def test_a_link_closed_while_its_receiver_reads_ends_quietly(hub):
    """A rank's map or trial link closed while its receiving thread was between recv's check and its
    read: multiprocessing reads from the handle close() set to None (a TypeError), which printed
    "Exception ignored in thread" into the user's cell after a Ranks.map (issue #54)."""
    import threading

    hub, _ = hub
    link, said, lost, reading = Link(0, hub.environ), [], [], threading.Event()

    class ClosedUnderneath:  # the real connection, whose next read comes after close took its handle
        def __init__(self, conn):
            self._conn = conn

        def recv(self):
            reading.set()
            while not link._closing:
                threading.Event().wait(0.01)
            return self._conn._recv(4)  # as Connection.recv reads once close() set the handle to None

        def __getattr__(self, name):
            return getattr(self._conn, name)

    link._conn = ClosedUnderneath(link._conn)
    previous, sys.unraisablehook = sys.unraisablehook, lambda unraisable: said.append(unraisable.exc_value)
    try:
        link.listen(lambda message: None, lambda: lost.append(True))
        assert reading.wait(10)
        link.close()
        threading.Event().wait(0.5)  # the receiving thread's end, were it to print anything
    finally:
        sys.unraisablehook = previous
    assert said == [] and lost == []
