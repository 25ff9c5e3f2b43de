"""What the remote placements share: the cluster object, the plan, the channel's address,
the ranks' environment and their entry point on the far side.

A remote rank is the same rank as a local one (`nbtrain.rank.loop.remote_main`): it dials the
notebook's channel, proves the launch's random authkey, and from then on speaks the same
protocol. Only where its process comes from, and how it is stopped, is the engine's.
"""
from __future__ import annotations

import importlib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass

import psutil

from ...common.devices import BACKENDS, DevicePlan
from ...common.transfer import pack_job
from ...rank.remote_entry import CWD_VAR, MACHINE_VAR, PATH_VAR, machine_identity
from ..base import Job, ProcessLauncher, RankProcess, rank_environ

# Set per rank by the engine, not from the notebook's view of the job:
PER_RANK = ("RANK", "ROLE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


class Cluster:
    """Where ranks run when not on this machine. `Slurm` and `Ray` are the two kinds.

    `notebook_address`: the address the ranks dial to reach this notebook (default: chosen
    per engine, see `channel_options`).
    """

    engine = ""
    extra = ""  # nbtrain's extra that installs the engine's client

    def __init__(self, notebook_address: str | None = None):
        if notebook_address is not None and (not isinstance(notebook_address, str) or not notebook_address.strip()):
            raise ValueError(f"notebook_address={notebook_address!r}: give a host name or IP address of this "
                             "machine that the cluster's nodes can reach, e.g. '10.0.0.5', or None to choose one.")
        self.notebook_address = notebook_address.strip() if notebook_address else None

    def plan(self, devices, accelerator: str, backend: str | None, num_nodes: int) -> ClusterPlan:
        """The devices of a run on this cluster (what `launch` calls with its own arguments).

        Parameters
        ----------
        devices : int or 'auto'
            Ranks per node.
        accelerator : {'auto', 'gpu', 'cpu'}
            As for `launch`.
        backend : str or None
            The process group's backend; None: nccl on GPUs, gloo on CPU.
        num_nodes : int
            Nodes.

        Returns
        -------
        ClusterPlan

        Raises
        ------
        ValueError
            The devices do not fit this cluster's settings.
        """
        raise NotImplementedError

    def placement(self) -> ProcessLauncher:
        """What starts this cluster's ranks, for one run (nbtrain calls it).

        Returns
        -------
        ProcessLauncher
        """
        raise NotImplementedError

    def where(self) -> str:
        """The engine and its settings, in words (shown in the run's title).

        Returns
        -------
        str
        """
        return self.engine

    def supervisor_environ(self) -> dict[str, str]:
        """What a submitted run's supervisor (another process) needs in its environment to reach
        the cluster this kernel uses.

        Returns
        -------
        dict
        """
        return {}


@dataclass(frozen=True)
class ClusterPlan(DevicePlan):
    """A plan for ranks on a cluster: `nprocs` per node, GPUs are the engine's to assign."""

    where: str = ""

    def describe(self) -> str:
        kind = "GPU" if self.accelerator == "gpu" else "CPU"
        plural = "s" if self.nprocs != 1 else ""
        nodes = f" per node x {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{self.nprocs} {kind} rank{plural}{nodes}, {self.backend}, on {self.where}"


def make_plan(per_node: int, num_nodes: int, accelerator: str, backend: str | None, where: str) -> ClusterPlan:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known. Accepted: {', '.join(BACKENDS)} (or None for nccl on "
                         "GPU, gloo on CPU).")
    if backend == "nccl" and accelerator == "cpu":
        raise ValueError("backend='nccl' needs GPUs, and this run is on CPU. Use 'gloo' (the default on CPU).")
    backend = backend or ("nccl" if accelerator == "gpu" else "gloo")
    return ClusterPlan(accelerator, tuple(range(per_node)), (), backend, num_nodes, where)


def count(value, what: str, default: int | None = None) -> int:
    """A positive count from an int or a string of digits ('auto' gives `default`)."""
    if isinstance(value, str) and value.strip() == "auto" and default is not None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or value < 1:
        raise ValueError(f"{what}={value!r}: on a cluster give a count of ranks, an int >= 1"
                         + (" (or 'auto')." if default is not None else ".")
                         + " Device indices are the engine's to assign on each node.")
    return value


def accelerator_of(accelerator: str, gpus: bool) -> str:
    name = accelerator.lower() if isinstance(accelerator, str) else accelerator
    name = "gpu" if name == "cuda" else name
    if name not in ("auto", "gpu", "cpu"):
        raise ValueError(f"accelerator={accelerator!r} is not known. Accepted: 'gpu' (or 'cuda'), 'cpu', 'auto'.")
    return ("gpu" if gpus else "cpu") if name == "auto" else name


def require(module: str, extra: str):
    """Import an engine's client, or say which of nbtrain's extras installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"this cluster needs the {module!r} package, which is not installed for {sys.executable}. "
            f"Install it with nbtrain's extra: pip install 'nbtrain[{extra}]'", name=module) from exc


def check_cluster(cluster) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r}: give nbtrain.Slurm(...) or nbtrain.Ray(...), or None for this machine.")
    return cluster


# -- the channel's address ------------------------------------------------------------------

def channel_options(notebook_address: str | None, default) -> dict:
    """Where the notebook's channel listens and the addresses ranks are told to dial.

    A given IP address of this machine is listened on alone; anything else (a host name, which
    may resolve here to a loopback address the nodes cannot use, or an address this machine is
    reached by but does not have) means every interface, and ranks are told that address;
    "0.0.0.0" means every interface, and ranks try each of this machine's addresses. Either
    way only a peer that proves the launch's random authkey is heard.
    """
    if notebook_address is None:
        host, advertise = default()
    elif notebook_address == "0.0.0.0":
        host, advertise = "0.0.0.0", notebook_addresses()
    else:
        host, advertise = (notebook_address if _bindable(notebook_address) else "0.0.0.0"), notebook_address
    return {"host": host, "advertise": advertise}


def notebook_addresses(toward: tuple[str, ...] = ()) -> list[str]:
    """Every address the nodes might reach this machine by, best first; each rank tries them in
    order. The host name alone is not enough: Debian and many clusters map it to a loopback
    address (127.0.1.1), which on a node is the node itself.

    First the address this machine would send from toward `toward` (hosts of the cluster, such
    as SLURM's controller: the network the nodes share), then the host name if it resolves
    here to a non-loopback address (the nodes may resolve it to a better one), then every other
    non-loopback IPv4 address of an interface that is up, then loopback, for ranks on this machine.
    """
    found = [_source_toward(host) for host in toward]
    name = socket.gethostname()
    if any(not ipaddress.ip_address(a).is_loopback for a in _resolve(name)):
        found.append(name)
    up = {nic for nic, stats in psutil.net_if_stats().items() if stats.isup}
    found += [a.address for nic, addrs in psutil.net_if_addrs().items() if nic in up for a in addrs
              if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    return [a for a in dict.fromkeys(found) if a and not a.startswith("127.")] + ["127.0.0.1"]


def _resolve(name: str) -> list[str]:
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)]
    except OSError:
        return []


def _source_toward(host: str) -> str | None:
    """The address this machine sends from to reach `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _bindable(address: str) -> bool:
    """An IPv4 address of this machine's own (names are not: see `channel_options`)."""
    try:
        ipaddress.IPv4Address(address)
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except (ValueError, OSError):
        return False


# -- the ranks' environment ------------------------------------------------------------------

def base_environ(job: Job, channel_env: dict[str, str]) -> dict[str, str]:
    """What every rank of a remote job shares: the torchrun-standard variables that are the
    same everywhere, the channel's address and authkey; the engine adds each rank's own."""
    env = rank_environ(job, 0, channel_env)
    for name in PER_RANK:
        env.pop(name, None)
    env[MACHINE_VAR] = machine_identity()
    env[PATH_VAR] = os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)
    env[CWD_VAR] = os.getcwd()
    return env


def rank_vars(rank: int, local_rank: int, local_world_size: int, node_rank: int, master_addr: str) -> dict[str, str]:
    return {"RANK": str(rank), "ROLE_RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank), "MASTER_ADDR": master_addr}


class RemoteRank(RankProcess):
    """A rank in a process the notebook does not own: the engine stops it, not a signal.

    `pid` is 0: the rank's own pid arrives in its hello, over the channel.
    """

    def __init__(self, ranks: list[int]):  # the base's callbacks are this class's own methods
        self.ranks, self.pid, self.exited_at = ranks, 0, None

    def poll(self) -> int | None:
        raise NotImplementedError

    def join(self, timeout: float) -> None:
        raise NotImplementedError

    def signal(self, sig: int) -> None:  # SIGTERM and SIGKILL both mean: end it, through the engine
        self.stop()

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RemotePlacement(ProcessLauncher):
    """A placement whose ranks run in processes an engine starts, possibly on other machines."""

    remote = True

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def _quirk_env(self, job: Job, display) -> dict:
        return {}  # this machine's GPU quirks say nothing about the nodes'

    def _prepare(self, job: Job) -> Job:
        return job if job.live else job.with_options(payload=pack_job(job.fn, job.args, job.kwargs))
