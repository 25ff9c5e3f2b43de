"""A submitted run's directory: its files, and the append-only event logs that are its only link
to any notebook.

An event is one JSON line written by a single `os.write` on an `O_APPEND` descriptor, so a line
is either whole or absent: a writer killed mid-run leaves at most a trailing partial line, which
`Tail` leaves unread until its newline arrives. Whole files (the status, the result) are written
to a temporary name and renamed, so a reader sees the old file or the new one, never half.
The directory is 0700 and its files 0600: nothing secret is written, and nothing is shared.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from .private import write_private

JOB = "job.pkl"  # the function and its arguments, pickled as launch ships them
OBJECTS = "launch.pkl"  # launch's settings that are objects: cluster, trackers, profile
SPEC = "run.json"  # what was asked: function, devices, strategy, max_restarts, when
STATUS = "status.json"  # queued, running, restarting, finished, failed, cancelled; the supervisor's pid
EVENTS = "events.jsonl"  # run-level events: each attempt's start, notes, restarts, the end
RESULT = "result.pkl"  # the Result, pickled (a finished run)
ERROR = "error.pkl"  # the WorkerError, pickled (a failed run)
SUPERVISOR_LOG = "supervisor.log"  # the supervisor's own stdout and stderr
SUPERVISOR = "supervisor.json"  # the supervisor's pid and start time (common/session.py)

ACTIVE = ("queued", "running", "restarting")
ENDED = ("finished", "failed", "cancelled")


def rank_events(rank: int) -> str:
    return f"rank-{rank}.jsonl"


def make_private_dir(path: Path) -> None:
    """Create `path` (0700); refuse one that exists with anything in it: two runs never share."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"run_dir={str(path)!r} exists and is not empty; give a new or empty directory "
                              "(or leave run_dir unset for a new one under ./nbtrain-runs/).")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def new_run_dir(base: Path, name: str, mode: int = 0o700) -> Path:
    """A new directory `base/<time>-<name>` (then -2, -3... for one made in the same second),
    each taken by an atomic mkdir: a submit and a tracked launch never share one."""
    base.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
    for n in range(1, 1000):
        path = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir(mode=mode)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory named {stem}-N under {base}")


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` to `path` as a whole, 0600 (`private.write_private`): IncompleteWrite if not."""
    write_private(path, data)


def write_json(path: Path, value: dict) -> None:
    write_whole(path, json.dumps(value, indent=1).encode())


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


class EventLog:
    """Appends events (JSON-able lists) to one file, each as one whole line."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, *event) -> None:
        # One write call per line: O_APPEND puts it at the end whole, even with other writers.
        os.write(self.fd, (json.dumps(event, default=repr) + "\n").encode())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Tail:
    """Reads the whole lines appended to a file since the last read; a partial last line waits."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[list]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # a line cut by a full disk: skip it, keep the rest
                continue
        return events
