"""Drop-ins for the launchers people's code already calls, on nbtrain's placements.

`nbtrain.spawn` has `torch.multiprocessing.spawn`'s signature and calls `fn(i, *args)` on each
rank, as the PyTorch DDP tutorial expects; `nbtrain.notebook_launcher` has Accelerate's. Both
run through `launch`, so CUDA in the kernel, failures, interrupts, the live view and results
work as they do there (both return the `Result`, where the originals return None).
"""
from __future__ import annotations

from collections.abc import Callable

from ..common.errors import WorkerError, launcher_failed
from ..rank.compat import LauncherCall, SpawnCall
from .run.launch import launch
from .run.result import Result

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
START_METHODS = {"spawn": "template", "forkserver": "template", "fork": "fork"}  # torch's: how nbtrain starts ranks


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn", *, accelerator: str = "auto", timeout: float | None = None,
          progress=True) -> Result:
    """`torch.multiprocessing.spawn` on nbtrain's ranks: `fn(i, *args)` on `nprocs` ranks, `i`
    being the rank. `start_method="spawn"` (torch's default) starts them from nbtrain's warm
    template: fresh processes, safe with CUDA in the kernel, at fork speed (where the template
    cannot start, fresh interpreters from `multiprocess`'s spawn context, as `start="spawn"`);
    `"fork"` forks the kernel. A rank's exception is raised here as a `WorkerError` naming the
    rank, where torch raises `ProcessRaisedException`.
    """
    if not callable(fn):
        raise TypeError(f"spawn(fn=...) needs a callable, got {type(fn).__name__}.")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: give the number of ranks, an int >= 1.")
    if not isinstance(args, tuple):
        raise TypeError(f"args={args!r}: give a tuple, as torch.multiprocessing.spawn takes (e.g. args=(world_size,)).")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not known. Accepted: {', '.join(START_METHODS)}.")
    if not join:
        raise ValueError("spawn(join=False): nbtrain.spawn runs the ranks to their end and returns their Result. "
                         "For ranks that stay while other cells run, use nbtrain.Ranks(devices=N).")
    return launch(SpawnCall(fn, args), devices=nprocs, accelerator=accelerator, timeout=timeout, progress=progress,
                  strategy="ddp", start=START_METHODS[start_method])


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static",
                      rdzv_endpoint: str = "", rdzv_conf: dict | None = None, rdzv_id: str = "none",
                      max_restarts: int = 0, monitor_interval: float = 0.1, log_line_prefix_template=None, *,
                      accelerator: str = "auto", timeout: float | None = None, progress=True) -> Result:
    """Accelerate's `notebook_launcher` on nbtrain's ranks: `function(*args)` on `num_processes`
    ranks (None: as `devices="auto"` decides: every visible GPU, else a CPU rank per core), where
    `Accelerator()` joins them as under `accelerate launch`. `max_restarts` restarts the whole
    run after a failure, as `launch(max_restarts=...)` does. `use_port`, `master_addr` and the
    rendezvous settings are accepted and ignored: nbtrain picks a free port for each launch
    (a fixed 29500 clashes with the last run's). More than one node: use `%%nbtrain --nnodes`.
    A failed rank raises a `WorkerError` that is also torch's ``ChildFailedError``, as
    Accelerate's raises.
    """
    if not callable(function):
        raise TypeError(f"notebook_launcher(function=...) needs a callable, got {type(function).__name__}.")
    if not isinstance(args, tuple):
        raise TypeError(f"args={args!r}: give a tuple of the function's arguments.")
    if num_nodes != 1 or node_rank != 0:
        raise ValueError(f"num_nodes={num_nodes}, node_rank={node_rank}: nbtrain.notebook_launcher runs on this "
                         "machine. For several machines run the cell with `%%nbtrain --nnodes N --node-rank K "
                         "--rdzv-endpoint HOST:PORT` on each, or use cluster=nbtrain.Slurm(...) / nbtrain.Ray(...).")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not known. Accepted: {', '.join(MIXED_PRECISION)}.")
    devices = "auto" if num_processes is None else num_processes
    job = LauncherCall(function, args, {"ACCELERATE_MIXED_PRECISION": mixed_precision})
    try:
        return launch(job, devices=devices, accelerator=accelerator, timeout=timeout, progress=progress,
                      max_restarts=max_restarts)
    except WorkerError as error:  # Accelerate's callers catch torch's ChildFailedError: this is one too
        raise launcher_failed(error) from error.__cause__


__all__ = ["spawn", "notebook_launcher", "WorkerError"]
