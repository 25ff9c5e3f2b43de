"""Data for each rank: `ctx.loader`, a DataLoader that gives every rank its own part of the data
(a DistributedSampler, moved to the next epoch on each pass), and the effective batch size told to
the notebook once. `DataLoading` adds the method to `Context`.
"""
from __future__ import annotations

from typing import Any

from ..common import protocol
from .place import RankPlace
from .tally import timed_batches


class DataLoading(RankPlace):
    """`Context`'s data loader (documented there)."""

    def loader(self, dataset, **dataloader_kwargs) -> EpochLoader:
        """A DataLoader that gives each rank its own part of the data, reshuffled every epoch.

        With several ranks, a DistributedSampler is added (unless a sampler is given) and its
        ``set_epoch`` called on every new pass. The effective batch size (batch x ranks) is
        reported once, as ``Result.effective_batch_size``.

        Parameters
        ----------
        dataset : Dataset
            The data.
        **dataloader_kwargs
            DataLoader's own (``batch_size``, ``shuffle``, ``num_workers``...); ``shuffle`` goes
            to the sampler.

        Returns
        -------
        EpochLoader
            Iterates as the DataLoader; other attributes are the DataLoader's.
        """
        from torch.utils.data import DataLoader, DistributedSampler

        sampler: DistributedSampler | None = None
        if self.world_size > 1 and not {"sampler", "batch_sampler"} & dataloader_kwargs.keys():
            shuffle = dataloader_kwargs.pop("shuffle", False)
            sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                         drop_last=dataloader_kwargs.get("drop_last", False))
            dataloader_kwargs["sampler"] = sampler
        loader = DataLoader(dataset, **dataloader_kwargs)
        self._report_batch_size(loader.batch_size)
        return EpochLoader(loader, sampler)

    def _report_batch_size(self, per_rank: int | None) -> None:
        if self._reported_batch or per_rank is None:
            return
        self._reported_batch = True
        # DataParallel splits the loader's batch across GPUs: the loader's batch is the effective one.
        effective = per_rank if self._dp_device_ids else per_rank * self.world_size
        self._sink.emit(protocol.BatchSize(self.rank, per_rank, effective))


class EpochLoader:
    """A DataLoader whose sampler moves to the next epoch on each new iteration."""

    def __init__(self, loader, sampler=None):
        self.loader = loader
        self._sampler = sampler
        self._epoch = 0

    def __iter__(self):
        if self._sampler is not None:
            self._sampler.set_epoch(self._epoch)
        self._epoch += 1
        return timed_batches(iter(self.loader))  # the wait for each batch is the rank's data wait

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
