"""What SLURM says, in nbtrain's words: srun's and slurmstepd's lines about a task's end, and
why a PENDING job can never start."""
from __future__ import annotations

import re
import signal
import subprocess

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


def node_exists(name: str) -> bool:
    try:
        done = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: keep waiting
    return not (done.returncode != 0 and "not found" in (done.stdout + done.stderr).lower())
