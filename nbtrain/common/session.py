"""A detached run's processes (through psutil): is its supervisor still the process it was, and
every process of its session and tree, to stop them all.

A pid alone is not an identity (pids are reused): a process is named by its pid and its start
time, so a run whose supervisor died is never taken for running because its pid came back.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from .process_tree import running, tree


def identity(pid: int) -> dict:
    """The process `pid` as run directories name it: {"pid", "start"}, "start" None if there is none."""
    try:
        return {"pid": pid, "start": _start(psutil.Process(pid))}
    except psutil.Error:
        return {"pid": pid, "start": None}


def _start(process: psutil.Process) -> str:
    """When `process` started, in clock ticks since boot (proc(5)'s starttime, as run directories
    have always stored it): unlike psutil's create_time, it does not move when the clock is set."""
    since_boot = process.create_time() - psutil.boot_time()
    return str(round(since_boot * os.sysconf("SC_CLK_TCK")))


def alive(who: dict | None) -> bool:
    """Whether the process `identity` named still runs (a zombie does not); for a supervisor that
    is a SLURM batch job (`{"slurm_job": ID}`), whether the job is still in the queue. None (a
    damaged or missing identity) names nothing alive."""
    if who is None:
        return False
    if "slurm_job" in who:
        return slurm_state(who["slurm_job"]) in SLURM_ACTIVE
    try:
        process = psutil.Process(who["pid"])
        return _start(process) == who.get("start") and running(process)
    except psutil.Error:
        return False


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
    return sorted(p.pid for p in _members(pid))


def _members(pid: int) -> list[psutil.Process]:
    found = {p.pid: p for p in tree(pid)}
    for other in psutil.process_iter():
        with contextlib.suppress(OSError):
            if other.pid not in found and os.getsid(other.pid) == pid:
                found[other.pid] = other
    return [p for p in found.values() if running(p)]


def stop(pid: int, grace: float = 15.0) -> None:
    """SIGTERM to `pid` (a supervisor stops its ranks and cleans up), SIGKILL to whatever of its
    session and tree is left after `grace` seconds (never to a process that merely got one of
    their pids since: psutil checks)."""
    first = _members(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(running(p) for p in first + _members(pid)):
        time.sleep(0.1)
    for process in first + _members(pid):
        with contextlib.suppress(psutil.Error):
            process.kill()
