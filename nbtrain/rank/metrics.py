"""Metrics and the collectives a training function calls: `ctx.log`, `all_gather`, `barrier`, and
`print` on rank 0. A metric goes to the notebook's live view (and `Result.history`) and to the
run's trackers; with ``sync_dist`` it is the mean over ranks. `Metrics` adds these methods to
`Context`.
"""
from __future__ import annotations

import builtins

import torch
import torch.distributed as dist

from ..common import protocol
from .place import RankPlace


class Metrics(RankPlace):
    """`Context`'s metrics and collectives (documented there)."""

    def log(self, name: str, value, sync_dist: bool = False, step: int | None = None) -> float:
        """Record a metric: shown live, kept in ``Result.history``, sent to the run's trackers.

        Parameters
        ----------
        name : str
            The metric's name.
        value : float or tensor
            Its value (a tensor is reduced to its mean).
        sync_dist : bool, default False
            Record the mean over ranks (every rank must call it: a collective).
        step : int, optional
            Where on the x axis; by default one more than this metric's last. A resumed run
            passes its own, so its curve goes on where it stopped.

        Returns
        -------
        float
            The value recorded (the mean over ranks with ``sync_dist``).

        Raises
        ------
        ValueError
            ``step`` is not an int >= 0.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"ctx.log({name!r}, step={step!r}): step must be an int >= 0, or None for the next one")
        if isinstance(value, torch.Tensor):  # .item() on a one-element tensor is the cheap path
            value = value.item() if value.numel() == 1 else value.detach().float().mean().item()
        value = float(value)
        if sync_dist and self.world_size > 1:
            self._ensure_group()
            total = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
            dist.all_reduce(total)
            value = total.item() / self.world_size
        step = self._steps[name] if step is None else step
        self._steps[name] = step + 1
        self._sink.emit(protocol.Metric(step, self.rank, name, value, bool(sync_dist)))
        if self._trackers is not None:
            self._trackers.log(name, value, step, bool(sync_dist) or self.world_size == 1)
        return value

    def all_gather(self, x):
        """Every rank's ``x`` (a collective: every rank calls it).

        Parameters
        ----------
        x : tensor or object
            This rank's part; objects must pickle.

        Returns
        -------
        tensor or list
            Tensors stacked along a new first dimension, one row per rank; other objects a list
            in rank order.
        """
        if not isinstance(x, torch.Tensor):
            if self.world_size == 1:
                return [x]
            self._ensure_group()
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, x)
            return gathered
        if self.world_size == 1:
            return x.unsqueeze(0)
        self._ensure_group()
        local = x.to(self._comm_device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.stack(parts).to(x.device)

    def barrier(self) -> None:
        """Wait until every rank has reached this line (a no-op on one rank)."""
        if self.world_size > 1:
            self._ensure_group()
            dist.barrier()

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only (flushed).

        Parameters
        ----------
        *args
            As for ``print``.
        **kwargs
            As for ``print``.
        """
        if self.is_global_zero:
            builtins.print(*args, **{"flush": True, **kwargs})
