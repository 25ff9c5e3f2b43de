"""The notebook's view of a submitted SLURM job: its state in the queue, its tasks' ends, its cancel.

Everything the notebook shows of the ranks comes over the channel; submitit's per-task result
file only says that a task ended. The queue is asked with `squeue` on a thread of its own:
submitit's state watcher uses `sacct`, which needs SLURM's accounting database and is asked at
most once a minute.
"""
from __future__ import annotations

import pickle
import subprocess
import threading
import time

from ..base import describe_exit
from .base import RemoteRank
from .slurm import SlurmJobError
from .slurm_words import never_runs, node_exists, slurm_says

ASK_WAITING = 1.0  # seconds between squeue calls while the job waits or starts
ASK_RUNNING = 5.0  # ... while it runs (the channel says what matters then)
ASK_ENDING = 0.25  # ... while it is cancelled or ends: how soon "nothing left in the queue" is known
LEAVE_WAIT = 10.0  # how long the end of a run waits for its job to leave the queue before cancelling it
RESULT_GRACE = 3.0  # a task's result file may show up this long after the job left the queue (NFS)
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
STARTING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}


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
            self.never = never_runs(reason, node_exists)
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
