"""SLURM through submitit: one job, one task per rank, `devices` tasks on each of its nodes.

submitit writes the sbatch script, pickles the task function into a folder the nodes share,
submits and cancels; each task reads its place from submitit's `JobEnvironment` (global and
local rank, node, the job's host names: the first is the master). Everything the notebook
shows comes over the channel; submitit's per-task result file only says that a task ended.

The queue is asked with `squeue` on a thread of its own: submitit's state watcher uses
`sacct`, which needs SLURM's accounting database and is asked at most once a minute.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ...common.errors import NbtrainError
from ...common.leftovers import alive
from ...common.private import new_private_dir, private_dir
from ...rank.remote_entry import rank_entry
from ..base import Job, describe_exit
from .base import (
    Cluster,
    RemotePlacement,
    RemoteRank,
    accelerator_of,
    base_environ,
    channel_options,
    count,
    make_plan,
    notebook_addresses,
    rank_vars,
    require,
)

# Set by nbtrain from the plan and the arguments, so not accepted as sbatch options:
OWN_OPTIONS = {"nodes", "ntasks", "ntasks_per_node", "gpus_per_node", "partition", "time", "account", "output",
               "error", "job_name", "array", "open_mode", "signal"}
ASK_WAITING = 1.0  # seconds between squeue calls while the job waits or starts
ASK_RUNNING = 5.0  # ... while it runs (the channel says what matters then)
ASK_ENDING = 0.25  # ... while it is cancelled or ends: how soon "nothing left in the queue" is known
LEAVE_WAIT = 10.0  # how long the end of a run waits for its job to leave the queue before cancelling it
RESULT_GRACE = 3.0  # a task's result file may show up this long after the job left the queue (NFS)
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
STARTING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
TIME_WARNING = 90  # seconds: submitit's default --signal=USR2@90
# What srun and slurmstepd write to the job's stderr when a task ends badly or the job is cancelled:
SRUN_TASK = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+?)\s*$", re.M)
CANCELLED = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON (?P<host>\S+) CANCELLED AT (?P<at>\S+)"
                       r"(?: DUE TO (?P<why>[^*]+?))? \*\*\*")
SIGNAL_WORDS = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}  # "Killed": SIGKILL
# Why a job is PENDING, for the reasons that waiting cannot clear (squeue's %r): the job is
# cancelled at once and the run fails with these words. Others (Resources, Priority, group
# limits that free up as other jobs end) wait, bounded by Slurm(queue_timeout=) if given.
NEVER_RUNS = {
    "PartitionConfig": "it asks for more than its partition is configured to give (CPUs, memory or GPUs per "
                       "node, or nodes)",
    "PartitionNodeLimit": "it asks for more nodes than its partition allows (or has up)",
    "PartitionTimeLimit": "its time limit is longer than its partition allows",
    "BadConstraints": "no node has the features it asks for (constraint=)",
    "DependencyNeverSatisfied": "a job it depends on can never complete",
    "InvalidAccount": "its account is not valid",
    "InvalidQOS": "its QOS is not valid",
    "AccountNotAllowed": "its account may not use this partition",
    "QOSNotAllowed": "its QOS may not use this partition",
    "QOSMaxWallDurationPerJobLimit": "its time limit is longer than its QOS allows a job",
    "AssocMaxWallDurationPerJobLimit": "its time limit is longer than its account allows a job",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows a job",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than its QOS allows a job",
    "QOSMaxGRESPerJob": "it asks for more GPUs (GRES) than its QOS allows a job",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows a job",
    "QOSMinCpuNotSatisfied": "it asks for fewer CPUs than its QOS requires",
    "QOSMinGRES": "it asks for fewer GPUs (GRES) than its QOS requires",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than its account allows a job",
    "AssocMaxNodesPerJobLimit": "it asks for more nodes than its account allows a job",
    "AssocMaxGRESPerJob": "it asks for more GPUs (GRES) than its account allows a job",
}


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
            submitted = executor.submit(_task, base_environ(job, channel_env), job.first, job.live)
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


# -- the task, on a node --------------------------------------------------------------------

def _task(base: dict, first: tuple | None, live: bool) -> int:
    """One rank: a task of the job (run by submitit's `python -m submitit.core._submit`)."""
    import submitit

    env = submitit.JobEnvironment()
    # nbtrain drives these ranks from the notebook: a cancel ends them now (submitit would
    # ignore SIGTERM, waiting to requeue a preempted job), and the time limit is announced.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, _time_limit_near)
    per_node = env.num_tasks // env.num_nodes
    environ = {**base, **rank_vars(env.global_rank, env.local_rank, per_node, env.node, env.hostnames[0])}
    return rank_entry(environ, first, live)


def _time_limit_near(signum, frame) -> None:
    print(f"nbtrain: SLURM says this job reaches its time limit in about {TIME_WARNING} s; it is then stopped.",
          file=sys.stderr, flush=True)


# -- the notebook's view of the job -----------------------------------------------------------

class SlurmJobError(NbtrainError, RuntimeError):
    """A SLURM job that cannot run its ranks: refused when submitted, pending for a reason that
    waiting cannot clear, or queued longer than `queue_timeout`. The notebook shows its one line."""

    def _render_traceback_(self) -> list[str]:
        return [f"SlurmJobError: {self}"]


class Queue:
    """One submitted job: its state in SLURM's queue, asked of squeue, and its tasks' ends."""

    def __init__(self, submitted, cluster: str = "Slurm()", queue_timeout: float | None = None):
        self.job = submitted
        self.id = submitted.job_id
        self.cluster, self.queue_timeout = cluster, queue_timeout
        self.submitted_at = time.monotonic()
        self.ran = False  # it left PENDING once: queue_timeout no longer applies
        self.never: str | None = None  # why it can never start, in words
        self.state, self.reason, self.nodes, self.partition = "PENDING", "", "", ""
        self.gone = threading.Event()  # the job left the queue
        self.gone_at: float | None = None
        self.cancelled = False
        self.ending = False  # the run is over: the job should leave the queue now
        self._told = ""  # the last status line handed out
        self._outcomes: dict[int, tuple] = {}
        self._stop, self._wake = threading.Event(), threading.Event()
        self._ask()  # the first status is known at once
        self._thread = threading.Thread(target=self._watch, name="nbtrain-squeue", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self.gone.is_set() and not self._stop.is_set():
            if self.cancelled or self.ending:
                interval = ASK_ENDING
            else:
                interval = ASK_WAITING if self.state in STARTING else ASK_RUNNING
            self._wake.wait(interval)
            self._wake.clear()
            if not self._stop.is_set():
                self._ask()

    def _ask(self) -> None:
        try:
            done = subprocess.run(["squeue", "--noheader", "--jobs", self.id, "--format", "%T|%r|%N|%P"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return  # asked again later
        line = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                self._left()
            return  # the controller is busy or unreachable: ask again later
        if not line:
            self._left()
            return
        state, reason, nodes, partition = (line.split("|") + ["", "", ""])[:4]
        self.state, self.reason, self.nodes = state, reason, nodes or self.nodes
        self.partition = partition or self.partition
        self.ran = self.ran or state not in STARTING
        if state == "PENDING" and self.never is None:
            self.never = never_runs(reason, _node_exists)
        if state in ENDED:
            self._left()

    def _left(self) -> None:
        if not self.gone.is_set():
            self.gone_at = time.monotonic()
            self.gone.set()

    def status(self) -> tuple[str, bool]:
        waiting = self.state in STARTING and not self.gone.is_set()
        if waiting and self.never:
            self.cancel()
            raise SlurmJobError(f"SLURM job {self.id} can never start ({self.cluster}): PENDING ({self.reason}): "
                                f"{self.never}{self._partition_has()}. nbtrain cancelled it: ask for less, or "
                                "another partition.")
        waited = time.monotonic() - self.submitted_at
        if waiting and not self.ran and self.queue_timeout is not None and waited > self.queue_timeout:
            self.cancel()
            why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
            raise SlurmJobError(f"SLURM job {self.id} waited {waited:.0f} s in the queue ({self.state}{why}), longer "
                                f"than queue_timeout={self.queue_timeout:g} ({self.cluster}); nbtrain cancelled it.")
        if self.gone.is_set() or self.cancelled:
            line = ""
        elif self.state == "PENDING":
            why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
            line = f"SLURM job {self.id} waits in the queue: PENDING{why}"
        elif self.state in STARTING:
            line = f"SLURM job {self.id}: {self.state}" + (f" on {self.nodes}" if self.nodes else "")
        else:
            line = f"SLURM job {self.id} runs on {self.nodes}" if self.state == "RUNNING" else ""
        new, self._told = (line if line != self._told else ""), line or self._told
        return new, waiting

    # -- the tasks ---------------------------------------------------------------------------
    def outcome(self, task: int) -> tuple | None:
        """submitit's ("success", exit code) or ("error", traceback) of a task that ended."""
        if task not in self._outcomes:
            path = self.job.task(task).paths.result_pickle
            try:
                with open(path, "rb") as f:
                    self._outcomes[task] = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                return None
        return self._outcomes[task]

    def exit_code(self, task: int) -> int | None:
        outcome = self.outcome(task)
        if outcome is not None:
            kind, value = outcome
            return value if kind == "success" and type(value) is int else 1
        if self.gone.is_set() and (self.cancelled or time.monotonic() - (self.gone_at or 0.0) > RESULT_GRACE):
            return 1  # the job ended and this task left no result: killed, or its node failed
        return None

    def explain(self, task: int, rank: int, code: int) -> str:
        where = f"SLURM job {self.id}, task {task}" + (f" on {self.nodes}" if self.nodes else "")
        outcome = self.outcome(task)
        if outcome is not None and outcome[0] == "error":
            last = [line for line in str(outcome[1]).strip().splitlines() if line.strip()][-1:]
            return f"{where} failed before rank {rank} reported: {last[0] if last else 'no traceback'}"
        if outcome is not None:
            return f"{where}: {describe_exit(code, None)}"
        reported = self.srun_report(task)
        if reported:
            return reported
        try:
            log = (self.job.task(task).stderr() or "").strip().splitlines()[-5:]
        except OSError:
            log = []
        tail = ("; its last log lines:\n" + "\n".join(log)) if log else ""
        return f"{where} ended (last seen {self.state}) before rank {rank} reported{tail}"

    def _partition_has(self) -> str:
        """'; partition debug has 1 node of 8 CPUs' (sinfo), or '' when sinfo cannot say."""
        if not self.partition:
            return ""
        try:
            done = subprocess.run(["sinfo", "--noheader", "--partition", self.partition, "--format", "%D|%c|%G"],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        lines = [line.split("|") for line in done.stdout.split() if line.count("|") == 2]
        if done.returncode != 0 or not lines:
            return ""
        parts = []
        for nodes, cpus, gres in lines:
            gpus = f" and {gres}" if gres not in ("(null)", "") else ""
            parts.append(f"{nodes} node{'s' if nodes != '1' else ''} of {cpus} CPUs{gpus}")
        return f"; partition {self.partition} has {', '.join(parts)}"

    def srun_report(self, task: int) -> str | None:
        """What SLURM wrote about this task's end in the job's stderr: its exit code or signal (srun),
        or the job's cancellation (slurmstepd); None if nothing yet."""
        texts = []
        for number in dict.fromkeys((0, task)):  # the batch script's stderr is task 0's file
            try:
                with open(self.job.task(number).paths.stderr, errors="replace") as f:
                    texts.append(f.read()[-65536:])
            except OSError:
                pass
        return slurm_says("\n".join(texts), self.id, task)

    # -- stopping ----------------------------------------------------------------------------
    def all_ended(self) -> bool:
        return all(self.outcome(task) is not None for task in range(self.job.num_tasks))

    def cancel(self) -> None:
        """scancel, through submitit; not for a job whose tasks all ended (it is leaving anyway)."""
        if not self.cancelled and not self.gone.is_set() and not self.all_ended():
            self.cancelled = True
            self.job.cancel(check=False)
            self._wake.set()

    def wait_ended(self, task: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.exit_code(task) is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        """Wait until the job left the queue (cancelling it if it does not), then stop asking."""
        self.ending = True
        self._wake.set()
        if not self.gone.wait(LEAVE_WAIT):
            self.cancel()
            self.gone.wait(LEAVE_WAIT)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=35)


class SlurmTask(RemoteRank):
    """A rank as one task of the job: it ends when its result file appears or the job leaves
    the queue; stopping it cancels the whole job (a launch's ranks live and die together)."""

    def __init__(self, queue: Queue, task: int, rank: int):
        super().__init__([rank])
        self.queue, self.task = queue, task

    def poll(self) -> int | None:
        return self.queue.exit_code(self.task)

    def stop(self) -> None:
        self.queue.cancel()

    def join(self, timeout: float) -> None:
        self.queue.wait_ended(self.task, timeout)

    def exit_reason(self, rank: int, code: int, pid: int | None) -> tuple[str, bool]:
        return self.queue.explain(self.task, rank, code), not self.queue.cancelled

    def lost_reason(self, rank: int) -> str | None:
        return self.queue.srun_report(self.task)

    def status(self) -> tuple[str, bool] | None:
        return self.queue.status() if self.task == 0 else None


def slurm_says(text: str, job: str, task: int) -> str | None:
    """What srun and slurmstepd wrote in a job's stderr (`text`) about task `task`'s end, in
    nbtrain's words: the job's cancellation, or the task's exit code or signal; None if nothing."""
    cancelled = CANCELLED.search(text)
    if cancelled:
        why = cancelled["why"]
        return (f"SLURM job {job} was cancelled at {cancelled['at']}"
                + (f" due to {why.strip().lower()}" if why else " (scancel)"))
    for found in SRUN_TASK.finditer(text):
        if task in _task_numbers(found["tasks"]):
            return f"SLURM job {job}, task {task} on {found['host']}: {_srun_words(found['what'])}"
    return None


def _task_numbers(spec: str) -> set[int]:
    """srun's task list: '1', '0-3', '0,2-3'."""
    numbers: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def _srun_words(what: str) -> str:
    """srun's 'Killed' or 'Exited with exit code 3' as nbtrain says it elsewhere."""
    code = re.fullmatch(r"Exited with exit code (\d+)", what)
    if code:
        return f"exited with code {code[1]}"
    number = SIGNAL_WORDS.get(what.removesuffix(" (core dumped)"))
    return f"Signal {int(number)} ({number.name})" if number else f"{what} (says srun)"


def never_runs(reason: str, node_exists) -> str | None:
    """Why a job PENDING for `reason` (squeue's %r) can never start, in words; None if waiting may
    help. `ReqNodeNotAvail, UnavailableNodes:n[1-2]` can never clear only when those nodes do not
    exist (`node_exists(name)` says); down or drained ones may come back."""
    code, _, detail = reason.partition(",")
    if code in NEVER_RUNS:
        return NEVER_RUNS[code]
    if code == "ReqNodeNotAvail":
        listed = detail.strip().partition("UnavailableNodes:")[2].strip()
        missing = [name for name in _hostnames(listed) if not node_exists(name)] if listed else []
        if missing:
            return f"the nodes it asks for do not exist in this cluster: {', '.join(missing)}"
    return None


def _hostnames(spec: str) -> list[str]:
    """SLURM's 'n[1-2],gpu3' as names."""
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.split() if done.returncode == 0 else []


def _node_exists(name: str) -> bool:
    try:
        done = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: keep waiting
    return not (done.returncode != 0 and "not found" in (done.stdout + done.stderr).lower())
