"""The submission of a launch's SLURM job through submitit: one job, one task per rank.

submitit writes the sbatch script, pickles the task function (`slurm_task.rank_task`) into a
folder the nodes share, submits and cancels; the job's life in the queue is `slurm_queue.Queue`'s.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from ...common.leftovers import alive
from ...common.private import new_private_dir, private_dir
from ..base import Job
from .base import RemotePlacement, base_environ, channel_options, notebook_addresses, require
from .slurm import Slurm, SlurmJobError
from .slurm_queue import Queue, SlurmTask
from .slurm_task import rank_task


class SlurmPlacement(RemotePlacement):
    cluster: Slurm  # the base knows a Cluster; this placement is made only for a Slurm

    def __init__(self, cluster: Slurm):
        super().__init__(cluster)
        self.folder: Path | None = None
        self.queue: Queue | None = None

    def channel_options(self, job: Job) -> dict:
        self.submitit = require("submitit", self.cluster.extra)  # named before anything runs

        def every_interface():  # the nodes' network is the one toward the controller
            return "0.0.0.0", notebook_addresses(toward=_controllers())

        return channel_options(self.cluster.notebook_address, every_interface)

    def _prepare(self, job: Job) -> Job:
        self.submitit = require("submitit", self.cluster.extra)
        if shutil.which("sbatch") is None:
            raise RuntimeError("cluster=Slurm(...): `sbatch` is not on PATH here. Run the notebook on a machine that "
                               "submits SLURM jobs (a login node, or a node of an interactive job).")
        job = super()._prepare(job)
        if self.cluster.folder is None:
            base = private_dir(Path.home() / ".cache" / "nbtrain" / "slurm")  # nbtrain's own: 0700, no one else's
        else:
            base = new_private_dir(self.cluster.folder)  # the user's: made 0700 if missing, else as it is
        _remove_orphans(base)
        # Private: the pickled job holds the channel's authkey. Named for its kernel, see _remove_orphans.
        self.folder = Path(tempfile.mkdtemp(prefix=f"job-{socket.gethostname()}-{os.getpid()}-", dir=base))
        return job

    def _parameters(self, job: Job) -> dict:
        cluster, plan = self.cluster, job.plan
        gpus = cluster.gpus_per_node or (plan.nprocs if plan.accelerator == "gpu" else None)
        given = {"partition": cluster.partition, "account": cluster.account, "gpus_per_node": gpus,
                 "setup": cluster.setup, "additional_parameters": cluster.sbatch_options or None}
        return {"job_name": "nbtrain", "nodes": plan.num_nodes, "ntasks_per_node": plan.nprocs,
                "time": cluster.time,  # None: the partition's default (submitit's own default is 5 minutes)
                **{k: v for k, v in given.items() if v is not None}}

    def _start(self, job, channel_env, pump, started) -> None:
        from submitit.core.utils import FailedJobError

        executor = self.submitit.SlurmExecutor(folder=self.folder)
        executor.update_parameters(**self._parameters(job))
        try:
            submitted = executor.submit(rank_task, base_environ(job, channel_env), job.first, job.live)
        except FailedJobError as exc:
            raise SlurmJobError(f"SLURM refused the job ({self.cluster!r}): {exc}") from None
        self.queue = Queue(submitted, repr(self.cluster), self.cluster.queue_timeout)
        started.extend(SlurmTask(self.queue, task, rank) for task, rank in enumerate(job.ranks))

    def _cleanup(self, job: Job) -> None:
        if self.queue is not None:
            self.queue.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _controllers() -> tuple[str, ...]:
    """The addresses (or names) of SLURM's controllers, as `scontrol show config` gives them:
    `SlurmctldHost[0] = name(address)` or `= name`."""
    try:
        done = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found = re.findall(r"^SlurmctldHost\[\d+\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", done.stdout, re.M)
    return tuple(address or name for name, address in found)


def _remove_orphans(base: Path) -> None:
    """Job folders of this machine's kernels that died before their run ended (killed)."""
    host = socket.gethostname()
    for folder in base.glob(f"job-{host}-*-*"):
        pid = folder.name[len(f"job-{host}-"):].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
