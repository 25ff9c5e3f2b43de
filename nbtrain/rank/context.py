"""The per-rank `Context`: who this rank is, and the helpers a training function needs.

A rank's Context is built from the torchrun-standard environment, so it is the same object
whether the rank was forked, spawned, started by torchrun or runs in the kernel itself.
"""
from __future__ import annotations

import builtins
import functools
import operator
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..common import protocol
from . import strategies
from .checkpoint import load, save
from .compat import destroy_group_now
from .steer import Steering
from .strategies import DDP_STRATEGIES, DEFAULT_MIN_PARAMS, SHARDED_STRATEGIES
from .tally import progressed, timed_batches

PROGRESS_INTERVAL = 0.1  # seconds between progress events of one bar


class _NoSink:
    def emit(self, message) -> None:
        pass


class Context:
    """This rank's place in the run, and the helpers a training function needs.

    Get it with `nbtrain.context()` inside the function a launch runs; it is built from the
    torchrun-standard environment, so it is the same whether the rank was forked, started from
    the warm template, spawned, started by torchrun or runs in the kernel itself. Its process
    group (gloo on CPU, nccl on GPU) is created on first need and destroyed when the rank ends.

    Parameters
    ----------
    rank : int, default 0
        This rank's global rank, 0 .. world_size - 1.
    local_rank : int, default 0
        Its rank on this machine.
    world_size : int, default 1
        Ranks in the run.
    local_world_size : int, default 1
        Ranks on this machine.
    device : torch.device or str, default 'cpu'
        The device this rank computes on (``cuda:<local_rank>`` on GPUs).
    strategy : str, default 'local'
        How `setup` wraps a model: 'single', 'dp', 'ddp', 'fsdp', 'deepspeed'; 'local' outside
        a launch.
    backend : str, default 'gloo'
        The process group's backend.
    sink : object, optional
        Where events go (progress, metrics); the launch sets it.
    dp_device_ids : tuple of int, default ()
        The GPUs of strategy 'dp'.

    Attributes
    ----------
    rank, local_rank, world_size, local_world_size, device, strategy, backend
        As given.
    """

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
        self._steps: dict[str, int] = defaultdict(int)
        self._depth = 0
        self._reported_batch = False
        self._trackers = None  # this run's tracker writers (trackers=), fed by log()
        self._recorder = None  # this run's profiler (profile=), stepped by step()
        self._deepest = -1  # the innermost progress level seen: its iterations are the steps
        self._explicit_steps = False  # the code calls step() itself
        self._steering = Steering(rank, self._sink.emit)  # run.pause() & co. (`launch(wait=False)`)

    @classmethod
    def from_environ(cls, environ=os.environ, sink=None) -> Context:
        """The Context of a rank started with the torchrun-standard environment.

        Parameters
        ----------
        environ : mapping, default os.environ
            Where RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (and nbtrain's own settings) are read.
        sink : object, optional
            Where events go.

        Returns
        -------
        Context
        """
        local_rank = int(environ.get("LOCAL_RANK", 0))
        accelerator = environ.get("NBTRAIN_ACCELERATOR") or ("gpu" if torch.cuda.is_available() else "cpu")
        device = torch.device("cuda", local_rank) if accelerator == "gpu" else torch.device("cpu")
        return cls(
            rank=int(environ.get("RANK", 0)),
            local_rank=local_rank,
            world_size=int(environ.get("WORLD_SIZE", 1)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", 1)),
            device=device,
            strategy=environ.get("NBTRAIN_STRATEGY", "ddp"),
            backend=environ.get("NBTRAIN_BACKEND") or ("nccl" if accelerator == "gpu" else "gloo"),
            sink=sink,
        )

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

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, local_rank={self.local_rank}, world_size={self.world_size}, "
                f"device={self.device}, strategy={self.strategy!r})")

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

    def _observe(self, trackers, recorder) -> None:
        """Attach (or, with None, detach) the trackers and the profiler of the command starting now."""
        self._trackers, self._recorder = trackers, recorder
        self._deepest, self._explicit_steps = -1, False
        if recorder is not None:
            recorder.start()

    def step(self) -> bool:
        """Mark the end of one training step: for a profile's window (``launch(..., profile=...)``),
        and as the step boundary where a run in the background is steered (`run.pause()` holds here).

        Without calls to it, each iteration of the innermost `progress` loop is a step.

        Returns
        -------
        bool
            True once ``run.stop()`` asked the training to end: a loop of your own ends then
            (`progress` loops end by themselves).
        """
        self._explicit_steps = True
        if self._recorder is not None:
            self._recorder.step()
        steering = self._steering
        steering.steps += 1
        return steering.pending and steering.at_boundary(True)

    def steer(self, **objects) -> None:
        """Register what a run in the background may be steered with, by name: ``run.call(fn)``
        passes them to ``fn`` by its parameters' names, ``run.set(lr=...)`` changes registered
        optimizers, ``run.checkpoint(path)`` saves them all.

        Parameters
        ----------
        **objects
            The training's objects: ``ctx.steer(model=model, optimizer=opt)``. Registering a
            name again replaces it.

        Raises
        ------
        ValueError
            No objects given, or a name that `run.call` offers itself (``ctx``, ``step``).
        """
        if not objects:
            raise ValueError("ctx.steer() needs the objects to register by name: ctx.steer(model=model, optimizer=opt)")
        taken = sorted({"ctx", "step"} & objects.keys())
        if taken:
            raise ValueError(f"ctx.steer({taken[0]}=...): {taken} is offered to run.call's functions already; "
                             "register it under another name.")
        self._steering.objects.update(objects)

    def _begin_command(self) -> None:
        # A live rank runs many commands: each one's progress bars start at the outer level.
        self._depth = 0
        self._steering.reset()

    def close(self) -> None:
        """Destroy the process group this Context created (the rank does it when it ends)."""
        if self._owns_group:
            destroy_group_now()
        self._owns_group = False

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # -- model and data -----------------------------------------------------------------
    def setup(self, module: torch.nn.Module, *, shard=None, min_params: int = DEFAULT_MIN_PARAMS,
              mixed_precision=None, cpu_offload=False, reshard_after_forward: bool = True) -> torch.nn.Module:
        """Move a model to this rank's device and wrap it as the run's strategy says.

        DistributedDataParallel under 'ddp' (``device_ids`` set on GPUs), DataParallel under
        'dp', FSDP2 sharding under 'fsdp', nothing on one device. The keyword options configure
        FSDP; other strategies check them and leave them unused, so one training function runs
        under ddp and fsdp alike.

        Parameters
        ----------
        module : torch.nn.Module
            The model.
        shard : type or tuple of types, optional
            Under fsdp: the module classes sharded as units of their own (say, a transformer
            block). Default: each submodule with at least ``min_params`` parameters.
        min_params : int
            Under fsdp, without ``shard``: the smallest submodule sharded on its own.
        mixed_precision : {'bf16', 'fp16'} or MixedPrecisionPolicy, optional
            Under fsdp: compute in this precision, parameters kept in float32.
        cpu_offload : bool or CPUOffloadPolicy, default False
            Under fsdp: keep the sharded parameters on the CPU.
        reshard_after_forward : bool, default True
            Under fsdp: free a unit's gathered weights after its forward pass, as FSDP2's option.

        Returns
        -------
        torch.nn.Module
            The wrapped model (the same module on one device).

        Raises
        ------
        TypeError
            ``module`` is not a torch.nn.Module.
        ValueError
            An option is not accepted (a ``shard`` that is not a module class, an unknown
            precision), or the module is already sharded.
        """
        options = strategies.ShardOptions.check(shard, min_params, mixed_precision, cpu_offload, reshard_after_forward)
        return strategies.wrap(module, self, options)

    def prepare_return(self, value):
        """The training function's return value, ready to leave this rank (the launch calls it).

        Parameters
        ----------
        value : object
            What the function returned.

        Returns
        -------
        object
            Under fsdp, sharded modules gathered whole to CPU on rank 0 (None on the others; a
            collective: every rank calls it); under other strategies, ``value`` itself.
        """
        if self.strategy in SHARDED_STRATEGIES:
            return strategies.gather_returned(value, self)
        return value

    @property
    def run_dir(self) -> Path | None:
        """The run's directory (`nbtrain.submit`, or ``launch(run_dir=...)`` with trackers or a
        profile): checkpoints kept there survive a restart of the ranks. None when there is none."""
        where = os.environ.get("NBTRAIN_RUN_DIR")
        return Path(where) if where else None

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path, **objects) -> None:
        """Save models, optimizers and plain state to a checkpoint directory.

        Every rank calls it and writes its own shard (torch.distributed.checkpoint); the
        checkpoint loads onto any number of ranks and any strategy.

        Parameters
        ----------
        path : str or Path
            The checkpoint's directory (made if missing).
        **objects
            What to save, by name: ``model=m, optimizer=opt, step=3``.

        Returns
        -------
        None

        Raises
        ------
        ValueError
            Nothing to save, or ``path`` is not a checkpoint's place.
        FileExistsError
            ``path`` exists and is not a checkpoint (nbtrain replaces only its own).
        CheckpointError
            The write failed (a full disk...): an OSError saying which rank and where.
        """
        save(self, path, objects)

    def load_checkpoint(self, path, **objects) -> dict:
        """Load what `save_checkpoint` saved, into the given models and optimizers, in place.

        Parameters
        ----------
        path : str or Path
            The checkpoint's directory.
        **objects
            The models and optimizers to load into, and plain names to read, by the names they
            were saved under: ``model=m, optimizer=opt, step=0``.

        Returns
        -------
        dict
            Every name's loaded value, plain state included (``loaded["step"]``).

        Raises
        ------
        FileNotFoundError
            No checkpoint at ``path``.
        CheckpointError
            The checkpoint lacks a name asked for, or cannot be read: an OSError saying which.
        """
        return load(self, path, objects)

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

    # -- metrics and collectives ---------------------------------------------------------
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

    # -- progress ------------------------------------------------------------------------
    def progress(self, iterable: Iterable, desc: str | None = None, total: int | None = None,
                 initial: int = 0) -> Iterator:
        """Iterate, reporting this rank's progress to the notebook's live view (nested calls nest).

        Parameters
        ----------
        iterable : iterable
            What to iterate over.
        desc : str, optional
            The bar's label; default 'epoch' for the outer loop, 'batch' inside it.
        total : int, optional
            Iterations in all; default ``initial + len(iterable)`` when it has a length (unlike
            tqdm: the iterable of a resumed loop is what is left).
        initial : int, default 0
            Iterations done before this loop, as in tqdm: a loop resumed from a checkpoint,
            ``ctx.progress(range(start, steps), initial=start)``, reads start..steps, and its
            rate and ETA count only the iterations done now.

        Returns
        -------
        iterator
            The iterable's items.

        Raises
        ------
        ValueError
            ``initial`` is not an int >= 0.
        """
        try:  # numpy's integers and a 0-d integer tensor (a step read back from a checkpoint) are ints too
            count = None if isinstance(initial, bool) else operator.index(initial)
        except TypeError:
            count = None
        if count is None or count < 0:
            raise ValueError(f"ctx.progress(initial={initial!r}): initial must be an int >= 0 (the iterations "
                             f"done before this loop, e.g. the step a checkpoint resumed from)")
        initial = count
        if total is None:
            try:
                total = initial + len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        return self._progress(iterable, desc, total, initial)

    def _progress(self, iterable: Iterable, desc: str | None, total: int | None, initial: int) -> Iterator:
        level = self._depth
        desc = desc or ("epoch" if level == 0 else "batch")
        self._depth += 1
        self._deepest = max(self._deepest, level)
        emit, rank = self._sink.emit, self.rank
        # Each event carries this rank's own clock: rates are told from when the steps happened
        # here, not from when batches of events reached the notebook. Each also carries `initial`,
        # where this loop began: the notebook tells a new loop by it, and counts only the steps after it.
        n, last = initial, time.monotonic()
        emit(protocol.Progress(rank, level, desc, n, total, False, last, initial))
        steering = self._steering
        try:
            if steering.stopping:  # run.stop(): a loop that begins after it has nothing left to do
                return
            for item in iterable:
                yield item
                n += 1
                progressed()
                counted = level == self._deepest and not self._explicit_steps  # a step boundary
                if counted:
                    steering.steps += 1
                    if self._recorder is not None:
                        self._recorder.step()
                if steering.pending and steering.at_boundary(counted):
                    break  # run.stop(): as if the loop had finished
                now = time.monotonic()
                if now - last >= PROGRESS_INTERVAL:
                    emit(protocol.Progress(rank, level, desc, n, total, False, now, initial))
                    last = now
        finally:
            self._depth -= 1
            emit(protocol.Progress(rank, level, desc, n, total, True, time.monotonic(), initial))


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


_current: Context | None = None


def set_current(ctx: Context | None) -> Context | None:
    global _current
    previous, _current = _current, ctx
    return previous


def context() -> Context:
    """This rank's `Context`: where it stands in the run, and its helpers.

    Inside a launched function, the running rank's. Outside a launch, one built from the
    torchrun environment (rank 0 of 1 when it is unset), so a function runs alike when called
    directly.

    Returns
    -------
    Context
    """
    global _current
    if _current is None:
        _current = Context.from_environ(os.environ) if "RANK" in os.environ else Context()
    return _current


def rank_zero_only(fn):
    """Decorate a function to run on global rank 0 only; elsewhere it returns None.

    Parameters
    ----------
    fn : callable
        The function.

    Returns
    -------
    callable
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if context().is_global_zero else None

    return wrapper
