"""The per-rank `Context`: who this rank is, and the helpers a training function needs.

A rank's Context is built from the torchrun-standard environment, so it is the same object
whether the rank was forked, spawned, started by torchrun or runs in the kernel itself. Its parts
live beside it: `place.py` (who the rank is, its device and process group: the base every part
reads), `steps.py` (progress loops, `step`, `steer`), `metrics.py` (`log` and the collectives),
`data.py` (`loader`); here are the class itself, the model's wrapping and checkpoints, and which
Context is this rank's (`context()`).
"""
from __future__ import annotations

import functools
import os
from collections import defaultdict
from pathlib import Path

import torch

from . import strategies
from .checkpoint import load, save
from .data import DataLoading
from .data import EpochLoader as EpochLoader  # defined here before: a pickle may name it here
from .metrics import Metrics
from .steer import Steering
from .steps import StepBoundaries
from .strategies import DEFAULT_MIN_PARAMS, SHARDED_STRATEGIES


class _NoSink:
    def emit(self, message) -> None:
        pass


class Context(StepBoundaries, Metrics, DataLoading):
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
        self._steps = defaultdict(int)
        self._depth = 0
        self._reported_batch = False
        self._trackers = None
        self._recorder = None
        self._deepest = -1
        self._explicit_steps = False
        self._steering = Steering(rank, self._sink.emit)

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

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, local_rank={self.local_rank}, world_size={self.world_size}, "
                f"device={self.device}, strategy={self.strategy!r})")

    # -- the model ----------------------------------------------------------------------
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
