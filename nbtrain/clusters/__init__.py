"""Ranks beyond this machine: `Slurm` (a job's tasks, through submitit) and `Ray` (actors).

    nbtrain.launch(train, cluster=nbtrain.Slurm(partition="gpu", gpus_per_node=4), num_nodes=2)
    ranks = nbtrain.Ranks(cluster=nbtrain.Ray(num_workers=4))

The run is the same as on this machine: one pool, channel, Context, display and error
type; the cluster object only chooses the placement (how rank processes start and stop).
Neither engine's client is imported until a cluster is used.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..launchers.base import Job
from .base import Cluster, check_cluster
from .ray import Ray
from .slurm import Slurm

__all__ = ["Cluster", "ClusterJob", "Ray", "Slurm", "launch_on"]
STRATEGIES = ("auto", "ddp", "fsdp")  # how ctx.setup wraps models; the engine starts the processes


@dataclass
class ClusterJob(Job):
    @property
    def ranks(self) -> list[int]:
        return list(range(self.plan.world_size))  # the notebook drives every node's ranks, not one node's


def launch_on(cluster, fn, args: tuple, kwargs: dict, *, strategy: str, devices, accelerator: str, num_nodes: int,
              backend: str | None, timeout: float | None, progress, launcher_options: dict | None):
    """`launch(..., cluster=...)`: the same run, its ranks placed by the cluster's engine."""
    from ..display import make_display

    cluster = check_cluster(cluster)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} with cluster={cluster!r}: the engine starts the ranks, each a process "
                         "of its own; give strategy='auto' or 'ddp' (ctx.setup wraps models in DDP), or 'fsdp' "
                         "(ctx.setup shards them).")
    if launcher_options:
        raise ValueError(f"launcher_options={launcher_options!r} are for ranks started on this machine; with a cluster, "
                         "give the engine's settings to the cluster object.")
    plan = cluster.plan(devices, accelerator, backend, num_nodes)
    display = make_display(progress)
    job = ClusterJob(fn, args, kwargs, plan, "ddp" if strategy == "auto" else strategy, timeout)
    return cluster.placement().launch(job, display)
