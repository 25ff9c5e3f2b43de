"""`Slurm`: a launch's SLURM job as the notebook asks for it, and `SlurmJobError`, a job that cannot run.

A run on SLURM is one job submitted through submitit, one task per rank, `devices` tasks on each
of its nodes: `slurm_submit.py` submits it (the placement), `slurm_task.py` is a task on a node
(one rank), `slurm_queue.py` follows the job in SLURM's queue until it leaves, and `slurm_words.py`
says what SLURM said, in nbtrain's words.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...common.errors import NbtrainError
from .base import Cluster, accelerator_of, count, make_plan

if TYPE_CHECKING:
    from .slurm_submit import SlurmPlacement

# Set by nbtrain from the plan and the arguments, so not accepted as sbatch options:
OWN_OPTIONS = {"nodes", "ntasks", "ntasks_per_node", "gpus_per_node", "partition", "time", "account", "output",
               "error", "job_name", "array", "open_mode", "signal"}


class Slurm(Cluster):
    """Run the ranks as the tasks of one SLURM job: ``launch(fn, cluster=nbtrain.Slurm(...))``.

    The job is submitted with submitit (``pip install 'nbtrain[slurm]'``) from the machine the
    notebook runs on (a login node, or a node of an interactive job). ``devices`` (launch's,
    or the cell's ``--devices``) is tasks per node, ``num_nodes`` (or ``nodes`` here) the
    job's nodes. The run is the same as on this machine: live view, metrics, errors, Ctrl-C.
    A job that can never start (it asks for more than its partition has) is cancelled at
    once, saying why.

    Parameters
    ----------
    partition : str, optional
        The partition; None: the cluster's default.
    time : int or str, optional
        The job's time limit: minutes, or a SLURM time such as '2:00:00'; None: the
        partition's default.
    account : str, optional
        The account charged.
    nodes : int, optional
        Nodes (or give ``num_nodes`` to `launch`).
    gpus_per_node : int, optional
        GPUs per node (and the default ranks per node).
    folder : str or Path, optional
        Where submitit keeps the job's files (the pickled job, logs) for the job's life; on a
        file system the nodes share. Default ~/.cache/nbtrain/slurm, private to you.
    setup : list of str, optional
        Shell lines run before the tasks (``module load cuda/12.4``).
    notebook_address : str, optional
        The address the nodes reach this notebook by; default chosen (the interface toward
        SLURM's controller).
    queue_timeout : float, optional
        Seconds a job may wait in the queue (for resources, priority) before it is cancelled;
        None waits as long as it takes.
    **sbatch_options
        Other sbatch options: ``qos='high'``, ``mem='32G'``, ``cpus_per_task=8``,
        ``constraint='a100'``; a flag as ``exclusive=True``.

    Raises
    ------
    ValueError
        A setting is not accepted, or is one nbtrain sets itself (``ntasks_per_node``...).
    """

    engine = "SLURM"
    extra = "slurm"

    def __init__(self, partition: str | None = None, time: int | str | None = None, account: str | None = None,
                 nodes: int | None = None, gpus_per_node: int | None = None, *, folder: str | os.PathLike | None = None,
                 setup: list[str] | None = None, notebook_address: str | None = None,
                 queue_timeout: float | None = None, **sbatch_options):
        super().__init__(notebook_address)
        for name, value in (("partition", partition), ("account", account)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r}: give the SLURM {name}'s name as a str, or None for the default.")
        if time is not None and not (type(time) is int and time > 0 or isinstance(time, str) and time.strip()):
            raise ValueError(f"time={time!r}: give minutes (an int > 0) or a SLURM time such as '2:00:00' or "
                             "'1-00:00:00', or None for the partition's default limit.")
        for name, given in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            if given is not None and (type(given) is not int or given < 1):
                raise ValueError(f"{name}={given!r}: give an int >= 1, or None.")
        if setup is not None and (isinstance(setup, str) or not all(isinstance(line, str) for line in setup)):
            raise ValueError(f"setup={setup!r}: give a list of shell lines, e.g. ['module load cuda/12.4'].")
        self.partition, self.time, self.account = partition, time, account
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.folder = Path(folder).expanduser() if folder is not None else None
        self.setup = list(setup) if setup is not None else None
        if queue_timeout is not None and (isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float))
                                          or not math.isfinite(queue_timeout) or queue_timeout <= 0):
            raise ValueError(f"queue_timeout={queue_timeout!r}: give the seconds a job may wait in SLURM's queue "
                             "before it is cancelled (a number > 0), or None to wait as long as it takes.")
        self.queue_timeout = queue_timeout
        self.sbatch_options = _sbatch_options(sbatch_options)

    def plan(self, devices, accelerator, backend, num_nodes):
        if self.nodes is not None and num_nodes not in (1, self.nodes):
            raise ValueError(f"num_nodes={num_nodes} but Slurm(nodes={self.nodes}): give the node count once.")
        per_node = count(devices, "devices", default=self.gpus_per_node or 1)
        return make_plan(per_node, self.nodes or num_nodes, accelerator_of(accelerator, bool(self.gpus_per_node)),
                         backend, self.where())

    def where(self) -> str:
        settings = [f"{k} {v}" for k, v in (("partition", self.partition), ("account", self.account)) if v]
        return "SLURM" + (f" ({', '.join(settings)})" if settings else "")

    def placement(self) -> SlurmPlacement:
        from .slurm_submit import SlurmPlacement  # imported when used: it imports this module's error

        return SlurmPlacement(self)

    def __repr__(self) -> str:
        given = {"partition": self.partition, "time": self.time, "account": self.account, "nodes": self.nodes,
                 "gpus_per_node": self.gpus_per_node, "queue_timeout": self.queue_timeout, **self.sbatch_options}
        return f"Slurm({', '.join(f'{k}={v!r}' for k, v in given.items() if v is not None)})"


def _sbatch_options(options: dict) -> dict:
    checked = {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name in OWN_OPTIONS:
            raise ValueError(f"sbatch option {key!r} is nbtrain's to set: use Slurm(partition=, time=, account=, "
                             "nodes=, gpus_per_node=) and launch's devices= (tasks per node).")
        if not isinstance(value, (str, int, float)) or value is False:
            raise ValueError(f"sbatch option {key}={value!r}: give a str or a number, or True for a flag "
                             "(e.g. exclusive=True).")
        checked[name] = value
    return checked


class SlurmJobError(NbtrainError, RuntimeError):
    """A SLURM job that cannot run its ranks: refused when submitted, pending for a reason that
    waiting cannot clear, or queued longer than `queue_timeout`. The notebook shows its one line."""

    def _render_traceback_(self) -> list[str]:
        return [f"SlurmJobError: {self}"]
