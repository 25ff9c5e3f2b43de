"""A detached run's processes, read from /proc: is its supervisor still the process it was, and
every process of its session and tree, to stop them all.

A pid alone is not an identity (pids are reused): a process is named by its pid and its start
time, so a run whose supervisor died is never taken for running because its pid came back.
"""
from __future__ import annotations

import os
import signal
import time

from .process_tree import descendants


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3 of proc(5) is index 0), or None."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2:].split()


def identity(pid: int) -> dict:
    fields = _stat(pid)
    return {"pid": pid, "start": fields[19] if fields else None}


def alive(who: dict) -> bool:
    """Whether the process `identity` named still runs (a zombie does not); for a supervisor that
    is a SLURM batch job (`{"slurm_job": ID}`), whether the job is still in the queue."""
    if "slurm_job" in who:
        return slurm_state(who["slurm_job"]) in SLURM_ACTIVE
    fields = _stat(who["pid"])
    return fields is not None and fields[19] == who.get("start") and fields[0] not in ("Z", "X")


SLURM_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def slurm_state(job: str) -> str:
    """The job's state as squeue says it; "" once it has left the queue (or squeue cannot say)."""
    import subprocess

    try:
        shown = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return shown.stdout.strip() if shown.returncode == 0 else ""


def stop_slurm_job(job: str, grace: float = 60.0) -> None:
    """scancel: SLURM sends the supervisor SIGTERM (it stops its ranks' job as a Ctrl-C would),
    then SIGKILL after the cluster's KillWait; wait until the job has left the queue."""
    import subprocess

    subprocess.run(["scancel", str(job)], capture_output=True, timeout=30)
    deadline = time.monotonic() + grace
    while slurm_state(job) in SLURM_ACTIVE and time.monotonic() < deadline:
        time.sleep(0.5)


def members(pid: int) -> list[int]:
    """Every live process of session `pid`, and every descendant of `pid` (a rank or helper may
    have started a session of its own, as the warm template does)."""
    found = set(descendants(pid))
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == pid:
            found.add(int(entry))
    return sorted(p for p in found if _running(p))


def stop(pid: int, grace: float = 15.0) -> None:
    """SIGTERM to `pid` (a supervisor stops its ranks and cleans up), SIGKILL to whatever of its
    session and tree is left after `grace` seconds."""
    tree = members(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(p) for p in tree + members(pid)):
        time.sleep(0.1)
    for p in set(tree + members(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")
