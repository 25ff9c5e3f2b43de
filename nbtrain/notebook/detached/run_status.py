"""Where a submitted run stands, read from its directory: status.json, checked against the
process that should be writing it (the supervisor named in supervisor.json, or while none is,
the kernel still submitting the run), so a run whose supervisor died reads failed, with why.

What is read back is this user's own: a run directory of another user, or one reached through a
symbolic link, is refused before any of it is read (`own_run_dir`). A damaged or impossible
file is an error naming the file and the run, at once, never a wait.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ...common import runlog, session
from ...common.private import check_own

STATUSES = (*runlog.ACTIVE, *runlog.ENDED)


def own_run_dir(run_dir) -> Path:
    """`run_dir` as a run directory of ours: refused if it is not a path, does not exist, is a
    link or another user's (before anything in it is read), or is not a run directory."""
    if not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir):
        raise TypeError(f"run_dir={run_dir!r}: give the path of a run directory (str or Path), one made by "
                        "nbtrain.submit (nbtrain.runs() lists them).")
    path = Path(run_dir).absolute()
    if not os.path.lexists(path):
        gone = runlog.remove_stale_partials(path.parent, path.name)
        said = " (its submit was interrupted; the partial directory it left was removed)" if gone else ""
        raise ValueError(f"{str(run_dir)!r} does not exist{said}: give a directory made by nbtrain.submit (by "
                         "default under ./nbtrain-runs/; nbtrain.runs() lists them).")
    check_own(path, "run directory")
    missing = [name for name in (runlog.SPEC, runlog.STATUS) if not (path / name).is_file()]
    if not path.is_dir() or missing:
        what = "is not a directory" if not path.is_dir() else f"is not a run directory (no {', '.join(missing)})"
        raise ValueError(f"{str(run_dir)!r} {what}: give a directory made by nbtrain.submit (by default under "
                         "./nbtrain-runs/; nbtrain.runs() lists them).")
    return path


def read_status(run_dir: Path) -> dict:
    """status.json as written."""
    path = run_dir / runlog.STATUS
    try:
        value = runlog.read_json(path, "status")
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r} is gone: the run directory was changed by something else than "
                         "nbtrain") from None
    if value["status"] not in STATUSES:
        raise ValueError(f"{str(path)!r} is damaged: its status {value['status']!r} is none of "
                         f"{', '.join(STATUSES)}")
    return value


def supervisor_of(run_dir: Path) -> dict | None:
    """Who supervises the run (supervisor.json); None if it was never recorded."""
    return identity(run_dir / runlog.SUPERVISOR, None)


def identity(path: Path, value) -> dict | None:
    """A process (`session.identity`) or SLURM job named in `path` (None: no such file), or in
    `value` when one is given (a status's submitter)."""
    if value is None:
        try:
            value = runlog.read_json(path)
        except FileNotFoundError:
            return None
    if not isinstance(value, dict) or ("slurm_job" not in value and not isinstance(value.get("pid"), int)):
        raise ValueError(f"{str(path)!r} is damaged: it names no process (a pid and start time) or SLURM job")
    return value


def current_status(run_dir: Path) -> dict:
    """status.json, or 'failed' with the reason where the process that should write it has gone."""
    value = read_status(run_dir)
    if value["status"] not in runlog.ACTIVE:
        return value
    who = supervisor_of(run_dir)
    if who is None:
        if value["status"] != "queued":  # the supervisor records itself before it says anything else
            raise ValueError(f"{str(run_dir / runlog.STATUS)!r} says the run is {value['status']}, but there is "
                             f"no {runlog.SUPERVISOR}: its supervisor cannot be found (the run directory is "
                             "damaged)")
        submitter = value.get("submitter")
        if submitter is not None and session.alive(identity(run_dir / runlog.STATUS, submitter)):
            return value  # still being submitted
        who = supervisor_of(run_dir)  # read again: it may have been recorded just now
        if who is None:
            value = read_status(run_dir)  # submit may have said why
            if value["status"] in runlog.ACTIVE:
                whom = f"(pid {submitter['pid']}) " if submitter else ""
                value.update(status="failed", reason=f"the run never started: the kernel that submitted it "
                                                     f"{whom}ended before the run's supervisor started")
            return value
    if not session.alive(who):  # read again: it may have written its end just before exiting
        value = read_status(run_dir)
        if not session.alive(who) and value["status"] in runlog.ACTIVE:
            whom = f"SLURM job {who['slurm_job']}" if "slurm_job" in who else f"pid {who['pid']}"
            said = last_words(run_dir)
            value.update(status="failed", reason=f"the run's supervisor ({whom}) ended without finishing it"
                                                 f"{': ' + said if said else ''}; see "
                                                 f"{run_dir / runlog.SUPERVISOR_LOG}")
    return value


def last_words(run_dir: Path) -> str:
    """The supervisor's last line of its own in supervisor.log (why it ended, if it could say)."""
    try:
        tail = runlog.read_own(run_dir / runlog.SUPERVISOR_LOG, -4096).decode(errors="replace")
    except OSError:
        return ""
    said = [line[len("nbtrain: "):] for line in tail.splitlines() if line.startswith("nbtrain: ")]
    return said[-1] if said else ""


def submitting(run_dir: Path) -> bool:
    """The kernel that submits the run is still at it (its supervisor is not recorded yet)."""
    submitter = read_status(run_dir).get("submitter")
    return submitter is not None and session.alive(identity(run_dir / runlog.STATUS, submitter))


def say_cancelled(run_dir: Path, max_restarts: int) -> None:
    """status.json says the run was cancelled (a damaged one is written anew)."""
    try:
        value = read_status(run_dir)
    except ValueError:
        value = {"restarts": [], "max_restarts": max_restarts}
    value.update(status="cancelled", reason="cancelled by Run.cancel()", ended=time.time())
    runlog.write_json(run_dir / runlog.STATUS, value)
