"""Ranks beyond this machine: `Slurm` (a job's tasks, through submitit) and `Ray` (actors).

    nbtrain.launch(train, cluster=nbtrain.Slurm(partition="gpu", gpus_per_node=4), num_nodes=2)
    ranks = nbtrain.Ranks(cluster=nbtrain.Ray(num_workers=4))

The run is the same as on this machine: one pool, channel, Context, display and error
type; the cluster object only chooses the placement (how rank processes start and stop).
Neither engine's client is imported until a cluster is used.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base import Job
from .base import Cluster, check_cluster
from .ray import Ray
from .slurm import Slurm

__all__ = ["Cluster", "ClusterJob", "Ray", "Slurm", "STRATEGIES", "check_cluster"]
STRATEGIES = ("auto", "ddp", "fsdp")  # how ctx.setup wraps models; the engine starts the processes


@dataclass(frozen=True)
class ClusterJob(Job):
    @property
    def ranks(self) -> list[int]:
        return list(range(self.plan.world_size))  # the notebook drives every node's ranks, not one node's
