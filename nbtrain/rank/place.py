"""What every part of a rank's `Context` stands on: who the rank is, its device and its process group.

`RankPlace` is the base of `context.Context`; the parts that add its helpers (`steps.py`,
`metrics.py`, `data.py`) derive from it, so each reads the same state. The state is made here, in
one place, with a note saying which part uses it.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from .compat import destroy_group_now
from .steer import Steering
from .strategies import DDP_STRATEGIES, SHARDED_STRATEGIES


class _NoSink:
    def emit(self, message) -> None:
        pass


class RankPlace:
    """A rank's place in the run: the base of `Context` (documented there)."""

    def __init__(self, rank: int = 0, local_rank: int = 0, world_size: int = 1, local_world_size: int = 1,
                 device: torch.device | str = "cpu", strategy: str = "local", backend: str = "gloo",
                 sink=None, dp_device_ids: tuple[int, ...] = ()):
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.device = torch.device(device)
        self.strategy = strategy
        self.backend = backend
        self._sink = sink or _NoSink()
        self._dp_device_ids = tuple(dp_device_ids)
        self._owns_group = False
        self._steps: dict[str, int] = defaultdict(int)  # metrics.py: each metric's next step
        self._depth = 0  # steps.py: the progress loops open now
        self._reported_batch = False  # data.py
        self._trackers = None  # this run's tracker writers (trackers=), fed by log()
        self._recorder = None  # this run's profiler (profile=), stepped by step()
        self._deepest = -1  # the innermost progress level seen: its iterations are the steps
        self._explicit_steps = False  # the code calls step() itself
        self._steering = Steering(rank, self._sink.emit)  # run.pause() & co. (`launch(wait=False)`)

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
