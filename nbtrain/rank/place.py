"""What every part of a rank's `Context` stands on: who the rank is, its device and its process group.

`RankPlace` is the base of `context.Context`; the parts that add its helpers (`steps.py`,
`metrics.py`, `data.py`) derive from it, so each reads the same state, declared here with a note
saying which part uses it (`Context.__init__` makes it).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .compat import destroy_group_now
from .strategies import DDP_STRATEGIES, SHARDED_STRATEGIES


class RankPlace:
    """A rank's place in the run: the base of `Context` (documented there), which makes this state."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    strategy: str
    backend: str
    _sink: Any  # where events go (progress, metrics): the rank's channel
    _dp_device_ids: tuple[int, ...]
    _owns_group: bool
    _steps: dict[str, int]  # metrics.py: each metric's next step
    _depth: int  # steps.py: the progress loops open now
    _reported_batch: bool  # data.py
    _trackers: Any  # this run's tracker writers (trackers=), fed by log()
    _recorder: Any  # this run's profiler (profile=), stepped by step()
    _deepest: int  # the innermost progress level seen: its iterations are the steps
    _explicit_steps: bool  # the code calls step() itself
    # run.pause() & co. (`launch(wait=False)`): a `steer.Steering`, made by Context (steer.py reads
    # the current Context back: imported here, it would close a circle through this module)
    _steering: Any

    @property
    def is_distributed(self) -> bool:
        """Several ranks, or a DDP or sharded strategy asked for explicitly (DDP on one rank, as Lightning does)."""
        return self.world_size > 1 or self.strategy in DDP_STRATEGIES or self.strategy in SHARDED_STRATEGIES

    @property
    def is_global_zero(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        """Machines in the run."""
        return max(1, self.world_size // max(1, self.local_world_size))

    # -- process group ------------------------------------------------------------------
    def _ensure_group(self) -> None:
        # Created on first need, so a user's own init_process_group() called earlier wins.
        if not self.is_distributed or dist.is_initialized():
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size)
        self._owns_group = True

    def start_group(self) -> None:
        """Create the default process group now rather than on first need.

        Live ranks do, so plain torch.distributed works in their first cell. A no-op for a
        single non-distributed rank, or when a group exists.
        """
        self._ensure_group()

    def close(self) -> None:
        """Destroy the process group this Context created (the rank does it when it ends)."""
        if self._owns_group:
            destroy_group_now()
        self._owns_group = False

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")
