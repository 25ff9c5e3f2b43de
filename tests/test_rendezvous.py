"""Ranks on one machine meet where only their user can: another local account, during a real
launch and while live ranks run, can neither reach nor write their rendezvous store."""
import datetime
import glob
import os
import stat
import sys

import pytest
import torch
import torch.distributed as dist

import nbtrain
from nbtrain.rank.rendezvous import STORE_VAR
from stranger import stranger  # noqa: F401 - a fixture

slow = pytest.mark.slow

# What another account tries, given the rank's MASTER_PORT and store directory: to join a TCP
# store there and set a key the ranks would read, to enter the directory, to open the store file.
PROBE = r'''
import datetime, json, os, sys
import torch.distributed as dist
port, directory = int(sys.argv[1]), sys.argv[2]
tried = {}
def attempt(what, how):
    try:
        how()
        tried[what] = "done"
    except Exception as exc:
        tried[what] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
def join_tcp_store():
    import socket
    socket.create_connection(("127.0.0.1", port), timeout=3).close()  # refused at once where nothing listens
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
    store.set("stranger", "was here")
attempt("MASTER_PORT", join_tcp_store)
attempt("list", lambda: os.listdir(directory))
attempt("file store", lambda: dist.FileStore(os.path.join(directory, "attempt-0"), -1).set("stranger", "was here"))
print(json.dumps(tried))
'''


def probed_by(user, before_group: bool):
    """In a rank: the stranger's probe, run while the launch goes on (before the process group
    exists or after), then a collective whose result says the ranks still work."""
    ctx = nbtrain.context()
    tried = None
    if before_group and ctx.rank == 0:  # rank 1 is already waiting in the group's set-up
        tried = _probe(user)
    ctx.barrier()  # the group: every rank's env:// went through the store
    if not before_group and ctx.rank == 0:
        tried = _probe(user)
    ctx.barrier()
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    store = dist.distributed_c10d._get_default_store().underlying_store  # below the group's prefix
    return {"tried": tried, "total": total.item(), "stranger's key": store.check(["stranger"]),
            "store": os.environ.get(STORE_VAR), "TCP store": "TCPStore" in repr(store)}


def _probe(user):
    return user.json(PROBE, os.environ["MASTER_PORT"], os.environ[STORE_VAR])


def _check(values, world_size=2):
    for value in values:
        assert value["total"] == sum(range(1, world_size + 1)), value
        assert value["stranger's key"] is False and value["TCP store"] is False, value
    tried = values[0]["tried"]
    assert set(tried) == {"MASTER_PORT", "list", "file store"}, tried
    # Nothing listens at MASTER_PORT; the directory and its store are closed to others.
    assert not tried["MASTER_PORT"].startswith("done"), tried
    assert tried["list"].startswith("PermissionError") and "Permission denied" in tried["file store"], tried


@slow
@pytest.mark.parametrize("start", ["fork", "template"])
@pytest.mark.parametrize("before_group", [True, False], ids=["while-starting", "while-running"])
def test_another_account_cannot_reach_a_launchs_store(start, before_group, stranger, no_leftovers):
    result = nbtrain.launch(probed_by, stranger, before_group, devices=2, accelerator="cpu", start=start,
                            progress=False, timeout=180)
    _check(result.values)
    assert not os.path.exists(result.values[0]["store"])  # removed with the launch


@slow
def test_another_account_cannot_reach_live_ranks_store(stranger, no_leftovers):
    with nbtrain.Ranks(devices=2, accelerator="cpu", progress=False) as ranks:
        _check(ranks.run(probed_by, stranger, False).values)
        store = ranks.eval(f"os.environ[{STORE_VAR!r}]")[0]
        assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert not os.path.exists(store)


@slow
def test_a_script_launch_on_one_node_meets_in_a_private_store_too(stranger, no_leftovers):
    # torchrun's own agent still hosts its TCP store at MASTER_PORT (its own keys only, see the
    # README); the ranks' process group no longer uses it.
    result = nbtrain.launch(probed_by, stranger, False, devices=2, accelerator="cpu", start="torchrun",
                            progress=False, timeout=180)
    for value in result.values:
        assert value["total"] == 3 and value["stranger's key"] is False and value["TCP store"] is False, value
    tried = result.values[0]["tried"]
    assert tried["list"].startswith("PermissionError"), tried


def test_a_killed_kernels_store_directory_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    from nbtrain.placements import base

    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read())  # no process has it: pids stay below pid_max
    monkeypatch.setattr(base, "SHM_DIR", str(tmp_path))
    left = tmp_path / f"nbtrain-store-{dead}-abcd1234"
    left.mkdir()
    (left / "attempt-0").write_bytes(b"")
    store = base.PrivateStore()
    try:
        assert not left.exists()
        assert os.path.dirname(store.path) == str(tmp_path)
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    finally:
        store.close()
    assert not os.path.exists(store.path)


def test_env_rendezvous_in_a_rank_opens_the_private_store(tmp_path, monkeypatch):
    # Whatever name init_process_group was bound to: torch consults its registry at each call.
    from nbtrain.rank.rendezvous import use_private_store

    registry = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    monkeypatch.setitem(registry, "env", registry["env"])  # put back after the test
    monkeypatch.setenv(STORE_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    use_private_store()
    store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=5)))
    assert (type(store).__name__, rank, world_size) == ("FileStore", 0, 1)
    store.set("k", "v")
    assert glob.glob(str(tmp_path / "attempt-0"))
    store, rank, world_size = next(dist.rendezvous("env://", rank=3, world_size=4))
    assert (rank, world_size, store.get("k")) == (3, 4, b"v")
