"""What the cluster placements share, without an engine: the channel's guard against strangers,
the address ranks dial, settings refused before anything starts, a missing engine named by its extra."""
import os
import queue
import socket
import sys
import psutil
import pytest

import nbtrain
from nbtrain.common.channel import ADDRESS_VAR, AUTHKEY_VAR, ChannelUnreachable, Hub, Link
from nbtrain.placements.clusters import base


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
        link.emit("hello", os.getpid())
        assert inbox.get(timeout=10)[:2] == ("hello", 0)
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
    link.emit("hello", 1)
    assert inbox.get(timeout=10)[:2] == ("hello", 1)
    link.close()
    assert inbox.empty() or inbox.get(timeout=1)[0] == "closed"


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
    started = time.monotonic()
    link = Link(0, hub.environ)  # a rank, in the middle of it
    link.emit("hello", os.getpid())
    assert inbox.get(timeout=10)[:2] == ("hello", 0)
    assert time.monotonic() - started < 5  # no queue of strangers ahead of it
    assert len(hub._strangers) <= channel.MAX_STRANGERS  # bounded: the oldest made room for the newest
    assert threading.active_count() <= threads + channel.MAX_STRANGERS + 10
    deadline = time.monotonic() + 10
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
    assert base.channel_options("login.example.invalid", default) == {"host": "0.0.0.0",
                                                                      "advertise": "login.example.invalid"}
    assert base.channel_options("0.0.0.0", default) == {"host": "0.0.0.0", "advertise": socket.gethostname()}
    # A name may resolve here to loopback, which the nodes cannot use: every interface, the name advertised.
    assert base.channel_options("localhost", default) == {"host": "0.0.0.0", "advertise": "localhost"}
    address = this_machines_address()
    if address is not None:  # one of this machine's own addresses is bound, and only it
        assert base.channel_options(address, default) == {"host": address, "advertise": address}


def test_a_rank_on_another_machine_returns_bytes_not_shared_memory(tmp_path):
    environ = {base.MACHINE_VAR: "elsewhere/boot/0:0", base.PATH_VAR: str(tmp_path), base.CWD_VAR: os.getcwd()}
    cwd, path = os.getcwd(), list(sys.path)
    try:
        assert base.here(environ)[base.SHARED_MEMORY_VAR] == "0"
        assert str(tmp_path) in sys.path
        assert base.SHARED_MEMORY_VAR not in base.here({base.MACHINE_VAR: base.machine_identity()})
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
    with pytest.raises(ValueError, match="strategy='ddp_fork' with cluster="):
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
    from nbtrain.placements.clusters.slurm import never_runs

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

    from nbtrain.notebook.magics import DEFAULTS, make_cluster

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
