"""Ray: one actor per rank, placed with a placement group; `ray.kill` and the group's removal stop them.

Each actor runs its rank inside one method call (`RankActor.run`). Ray runs the methods of a
plain (not async, one call at a time) actor on the worker process's main thread, so the
rank's command loop is where it would be locally; Ray blocks SIGINT in its workers, so the
rank unblocks it on that thread: an interrupt then lands in the user's code. Stacks are asked
for over the channel (faulthandler, on the rank's receiving thread), as for every remote rank.

Where the actors land is known only once the group is placed: each actor first reports its
node (and, for rank 0, a free port there), and every rank's `run` receives those reports as
resolved arguments, so all ranks agree on the master and on who shares a node.
"""
from __future__ import annotations

import socket
import sys
import time
import uuid

from ...common.errors import NbtrainError
from ...rank.remote_entry import rank_entry
from ..base import Job, describe_exit, free_port
from .base import (
    Cluster,
    RemotePlacement,
    RemoteRank,
    accelerator_of,
    base_environ,
    channel_options,
    count,
    make_plan,
    rank_vars,
    require,
)

PLACING_QUIET = 1.0  # seconds a placement may take before the display says it waits for resources
GCS_LOOK = 1.0  # seconds between looks at whether Ray's cluster still answers (and a look's limit)
LOCAL_START_TRIES = 3  # a local Ray whose start timed out is started again, twice at most (see _init)
STARTUP_TIMED_OUT = "timed out during startup"  # Ray's words for a node that missed its deadline


class Ray(Cluster):
    """Run the ranks as Ray actors: ``launch(fn, cluster=nbtrain.Ray(...))`` (``pip install 'nbtrain[ray]'``).

    The actors are placed with a Ray placement group; the run is the same as on this machine:
    live view, metrics, errors, Ctrl-C. A Ray cluster that goes away ends the run, said in words.

    Parameters
    ----------
    address : str, optional
        None joins the Ray that ``ray.init`` already started in this kernel, or starts a local
        one (or joins ``RAY_ADDRESS``; a local start that misses Ray's start-up deadline on a
        loaded machine is tried once more); 'auto', 'HOST:6379' or 'ray://HOST:10001' join a
        running cluster.
    num_workers : int, optional
        Ranks, placed wherever they fit. Without it, launch's ``devices`` ranks on each of
        ``num_nodes`` different nodes.
    use_gpu : bool, default False
        Each rank reserves a GPU.
    resources_per_worker : dict, optional
        What each rank reserves; default ``{'CPU': 1}``, plus ``{'GPU': 1}`` with ``use_gpu``.
    notebook_address : str, optional
        The address the actors reach this notebook by; default the one Ray's nodes use.

    Raises
    ------
    ValueError
        A setting is not accepted (more than one GPU per rank, a resource that is not a number).
    """

    engine = "Ray"
    extra = "ray"

    def __init__(self, address: str | None = None, num_workers: int | None = None, use_gpu: bool = False,
                 resources_per_worker: dict | None = None, *, notebook_address: str | None = None):
        super().__init__(notebook_address)
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ValueError(f"address={address!r}: give a Ray address ('auto', 'HOST:6379', 'ray://HOST:10001') "
                             "or None for this kernel's Ray.")
        if num_workers is not None and (type(num_workers) is not int or num_workers < 1):
            raise ValueError(f"num_workers={num_workers!r}: give an int >= 1 (the number of ranks), or None.")
        if not isinstance(use_gpu, bool):
            raise ValueError(f"use_gpu={use_gpu!r}: give True or False.")
        resources = dict(resources_per_worker or {})
        bad = {k: v for k, v in resources.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0}
        if bad:
            raise ValueError(f"resources_per_worker: {bad!r} are not resources. Give names and amounts, "
                             "e.g. {'CPU': 4, 'GPU': 1}.")
        resources.setdefault("CPU", 1)
        if use_gpu:
            resources.setdefault("GPU", 1)
        if resources.get("GPU", 0) > 1:
            raise ValueError(f"resources_per_worker={{'GPU': {resources['GPU']}}}: each rank drives one GPU "
                             "(ask for more ranks instead).")
        self.address, self.num_workers, self.use_gpu = address, num_workers, use_gpu or bool(resources.get("GPU"))
        self.resources = {k: v for k, v in resources.items() if v}

    def plan(self, devices, accelerator, backend, num_nodes):
        accelerator = accelerator_of(accelerator, self.use_gpu)
        if accelerator == "gpu" and not self.use_gpu:
            raise ValueError("accelerator='gpu' on Ray needs Ray(use_gpu=True): each rank then reserves a GPU.")
        if self.num_workers is None:
            per_node = count(devices, "devices", default=1)
        elif devices in ("auto", None):
            if num_nodes > 1:
                raise ValueError(f"Ray(num_workers={self.num_workers}) places ranks wherever they fit: give num_nodes "
                                 "with devices (ranks per node) instead of num_workers.")
            per_node = self.num_workers
        else:
            per_node = count(devices, "devices")
            if per_node * num_nodes != self.num_workers:
                raise ValueError(f"devices={devices!r} x num_nodes={num_nodes} is not Ray(num_workers="
                                 f"{self.num_workers}): give one or the other.")
        return make_plan(per_node, num_nodes, accelerator, backend, self.where())

    def where(self) -> str:
        return "Ray" + (f" at {self.address}" if self.address else "")

    def placement(self) -> RayPlacement:
        return RayPlacement(self)

    def supervisor_environ(self) -> dict[str, str]:
        # address=None is this kernel's Ray: the supervisor joins it by address, where its own
        # ray.init() would start a second Ray on this machine, competing for its CPUs and GPUs.
        ray = sys.modules.get("ray")  # not imported: this kernel has no Ray to share
        if self.address is not None or ray is None or not ray.is_initialized():
            return {}
        address = getattr(ray.get_runtime_context(), "gcs_address", None)
        return {"RAY_ADDRESS": address} if address else {}

    def __repr__(self) -> str:
        given = {"address": self.address, "num_workers": self.num_workers, "use_gpu": self.use_gpu or None,
                 "resources_per_worker": self.resources}
        return f"Ray({', '.join(f'{k}={v!r}' for k, v in given.items() if v is not None)})"


class RayPlacement(RemotePlacement):
    cluster: Ray  # the base knows a Cluster; this placement is made only for a Ray

    def __init__(self, cluster: Ray):
        super().__init__(cluster)
        self.group: RayGroup | None = None

    def _ray(self):
        ray = require("ray", self.cluster.extra)
        _keep_print()
        if not ray.is_initialized():
            if _LOST and self.cluster.address is None:  # a new local Ray is not the one that was lost
                raise RuntimeError(f"{_LOST[-1]}. Connect again with ray.init(...) (nbtrain then uses that Ray), "
                                   "or give nbtrain.Ray(address=...).")
            _init(ray, self.cluster.address)
        return ray

    def channel_options(self, job: Job) -> dict:
        ray = self._ray()

        def ray_node_address():  # the address Ray's other nodes reach this one by
            ip = ray.util.get_node_ip_address()
            return ip, ip

        return channel_options(self.cluster.notebook_address, ray_node_address)

    def _prepare(self, job: Job) -> Job:
        self.ray = self._ray()
        return super()._prepare(job)

    def _bundles(self, plan) -> tuple[list[dict], str, int]:
        """(bundles, strategy, ranks per bundle): a bundle per rank when Ray may place them
        anywhere, else a bundle per node, each on a different node."""
        per_worker = self.cluster.resources
        if self.cluster.num_workers is not None:
            return [dict(per_worker) for _ in range(plan.world_size)], "PACK", 1
        node = {k: v * plan.nprocs for k, v in per_worker.items()}
        strategy = "STRICT_SPREAD" if plan.num_nodes > 1 else "PACK"
        return [dict(node) for _ in range(plan.num_nodes)], strategy, plan.nprocs

    def _start(self, job, channel_env, pump, started) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        bundles, strategy, per_bundle = self._bundles(job.plan)
        group = self.group = RayGroup(placement_group(bundles, strategy=strategy,
                                                      name=f"nbtrain-{uuid.uuid4().hex[:8]}"),
                                      bundles, strategy)
        resources = dict(self.cluster.resources)
        options = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0),
                   "memory": resources.pop("memory", None), "resources": resources or None}
        actor_class = ray.remote(RankActor)
        base = base_environ(job, channel_env)
        places = []
        for rank in job.ranks:
            where = PlacementGroupSchedulingStrategy(group.group, placement_group_bundle_index=rank // per_bundle)
            actor = actor_class.options(**{k: v for k, v in options.items() if v is not None},
                                        scheduling_strategy=where, max_restarts=0).remote()
            group.actors.append(actor)
            places.append(actor.where.remote(rank == 0))
        group.places = places
        for rank, actor in zip(job.ranks, group.actors):
            # The reports are top-level arguments: Ray passes their values, once every actor is placed.
            started.append(RayRank(group, rank, actor.run.remote(base, rank, job.first, job.live, *places)))

    def _cleanup(self, job: Job) -> None:
        if self.group is not None:
            self.group.remove()


def _init(ray, address: str | None) -> None:
    """`ray.init`; a local Ray that missed Ray's own start-up deadline is started again (twice at most:
    once was not always enough on a loaded 2-core machine).

    Ray gives a new node's raylet a fixed 30 s to register with its GCS ("The current node timed
    out during startup"), which a loaded machine (a shared login node, a 2-core notebook server)
    can miss; the half-started node is shut down first. Joining a cluster (`address`) is not
    retried: a cluster that does not answer is the user's to see at once.
    """
    for attempt in range(LOCAL_START_TRIES):
        try:
            ray.init(address=address)
            return
        except Exception as exc:
            if address is not None or STARTUP_TIMED_OUT not in str(exc) or attempt == LOCAL_START_TRIES - 1:
                raise
            ray.shutdown()
            print(f"nbtrain: Ray's local start timed out ({exc}); starting it again", file=sys.stderr, flush=True)


def _keep_print() -> None:
    """Keep Ray from replacing the kernel's `print` (it does when it first shows a worker's log).

    Its replacement and a helper of Ray's call each other, and dill, walking what a shipped
    function uses (print included), recurses forever on that cycle: no function that prints
    could be sent to ranks again in this kernel.
    """
    import builtins
    import os

    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    if getattr(builtins.print, "__module__", "") == "ray.experimental.tqdm_ray":
        from ray.experimental import tqdm_ray

        builtins.print = tqdm_ray._print


class RankActor:
    """One rank, as a Ray actor."""

    def where(self, master: bool) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "port": free_port("0.0.0.0") if master else None}

    def run(self, base: dict, rank: int, first: tuple | None, live: bool, *places: dict) -> int:
        import signal

        # Ray blocks SIGINT in its workers; a rank's interrupt is SIGINT to this (the main) thread.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        mine = places[rank]
        together = [i for i, place in enumerate(places) if place["node"] == mine["node"]]
        nodes = list(dict.fromkeys(place["node"] for place in places))
        environ = {**base, **rank_vars(rank, together.index(rank), len(together), nodes.index(mine["node"]),
                                       places[0]["ip"]), "MASTER_PORT": str(places[0]["port"])}
        gpus = [gpu for i in together for gpu in places[i]["gpus"]]
        if gpus:  # as Ray Train does: a node's ranks see the node's GPUs of this job, LOCAL_RANK picks one
            environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return rank_entry(environ, first, live)


_LOST: list[str] = []  # why Ray went away under a run in this kernel


class RayGone(NbtrainError, RuntimeError):
    """Ray itself went away under the run: shut down in this kernel, or its cluster stopped."""


class RayGroup:
    """The placement group and its actors: what `_cleanup` removes."""

    def __init__(self, group, bundles: list[dict], strategy: str):
        import ray

        self.group, self.bundles, self.strategy = group, bundles, strategy
        self.actors: list = []
        self.places: list = []  # each actor's report of where it runs: ready once the actor exists
        self.started = time.monotonic()
        self._ready_ref = group.ready()
        self.placed = self.running = False
        self._told = False
        try:
            self.gcs = ray.get_runtime_context().gcs_address  # host:port of the cluster's control store
        except Exception:  # Ray Client, or a Ray that does not say: only a shutdown is noticed
            self.gcs = None
        self.lost: str | None = None
        self._looked = 0.0

    def gone(self) -> str | None:
        """Why Ray is no longer there, or None; looked at no more than once a second.

        Every later Ray call is skipped: after `ray.shutdown()` one would silently start a new
        local Ray. When the cluster's GCS stops answering, this kernel's Ray driver is shut
        down too: left connected, it ends the kernel's process about a minute later.
        """
        import ray

        if self.lost is None and not ray.is_initialized():
            self.lost = "Ray was shut down in this kernel (ray.shutdown()) while the ranks ran"
        elif self.lost is None and self.gcs and time.monotonic() - self._looked >= GCS_LOOK:
            self._looked = time.monotonic()
            host, _, port = self.gcs.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=GCS_LOOK).close()
            except OSError as exc:
                self.lost = (f"Ray's cluster went away: its GCS at {self.gcs} does not answer ({exc.strerror or exc}); "
                             "this kernel's Ray driver was shut down so that the kernel survives")
                ray.shutdown()
            if self.lost:
                _LOST.append(self.lost)
        return self.lost

    def status(self) -> tuple[str, bool]:
        """Waiting while the group is placed and the actors' processes start (Ray's queue):
        neither counts against `timeout` or the start clock."""
        import ray

        if self.gone():
            return "", False
        if not self.placed:
            self.placed = bool(ray.wait([self._ready_ref], timeout=0)[0])
        if self.placed and not self.running:
            self.running = len(ray.wait(self.places, num_returns=len(self.places), timeout=0)[0]) == len(self.places)
        if self.placed:
            return "", not self.running
        line = ""
        if not self._told and time.monotonic() - self.started > PLACING_QUIET:
            self._told = True
            free = {k: v for k, v in ray.available_resources().items() if k in self.bundles[0]}
            line = (f"Ray is waiting for resources: {len(self.bundles)} x {self.bundles[0]} ({self.strategy}); "
                    f"free now: {free}")
        return line, True

    def remove(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.gone():
            return  # nothing of it is left to remove, and a call would start a new Ray
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)


class RayRank(RemoteRank):
    def __init__(self, group: RayGroup, rank: int, ref):
        super().__init__([rank])
        self.group, self.actor, self.ref = group, group.actors[rank], ref  # actors are made in rank order
        self.code: int | None = None
        self.error: Exception | None = None
        self.killed = False

    def poll(self) -> int | None:
        import ray

        if self.code is None and self.group.gone():
            self.error, self.code = RayGone(self.group.lost), 1
        elif self.code is None and ray.wait([self.ref], timeout=0)[0]:
            try:
                self.code = int(ray.get(self.ref))
            except ray.exceptions.RayError as exc:  # the actor died, or its creation or run raised
                self.error, self.code = exc, 1
        return self.code

    def engine_gone(self) -> str | None:
        return self.group.gone()

    def stop(self) -> None:
        import ray

        self.killed = True
        if not self.group.gone():
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float) -> None:
        import ray

        if not self.group.gone():
            ray.wait([self.ref], timeout=timeout)

    def exit_reason(self, rank: int, code: int, pid: int | None) -> tuple[str, bool]:
        if isinstance(self.error, RayGone):
            return f"rank {rank} was lost with Ray: {self.error}", True
        if self.error is None:
            return f"Ray actor of rank {rank}: {describe_exit(code, pid)}", True
        lines = [line.strip() for line in str(self.error).splitlines() if line.strip()]
        # A task's error ends with the exception raised; an actor's death begins with its cause.
        text = lines[-1] if isinstance(self.error, self._task_error()) and lines else (lines[0] if lines else "")
        return f"Ray actor of rank {rank} ended before it reported: {text}", not self.killed

    @staticmethod
    def _task_error():
        import ray

        return ray.exceptions.RayTaskError

    def status(self) -> tuple[str, bool] | None:
        return self.group.status() if self.ranks[0] == 0 else None
