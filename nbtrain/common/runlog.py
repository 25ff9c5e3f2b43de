"""A submitted run's directory: its files, and the append-only event logs that are its only link
to any notebook.

An event is one JSON line written by a single `os.write` on an `O_APPEND` descriptor, so a line
is either whole or absent: a writer killed mid-run leaves at most a trailing partial line, which
`Tail` leaves unread until its newline arrives. Whole files (the status, the result) go through
`private.write_private`: a reader sees the old file or the new one, never half, and a write that
cannot finish says how far it got. The directory is 0700 and its files 0600: nothing secret is
written, and nothing is shared. Everything is read back through `private.read_own`: a file of
another user, or one reached through a link, is refused before a byte of it is read.

A run directory is written whole too: `submit` fills a `.partial-PID-START-NAME` directory and
renames it into place once every file is in it; a writer killed half-way leaves only that
partial directory, which names its writer, and `remove_stale_partials` removes it once its
writer is gone.
"""
from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import dill

from . import protocol, session
from .private import (
    IncompleteWrite,
    check_own,
    make_parents,
    open_own,
    private_dir,
    read_own,
    read_own_json,
    write_private,
)

JOB = "job.pkl"  # the function and its arguments, pickled as launch ships them
OBJECTS = "launch.pkl"  # launch's settings that are objects: cluster, trackers, profile
SPEC = "run.json"  # what was asked: function, devices, strategy, max_restarts, when; the formats' version
STATUS = "status.json"  # queued, running, restarting, finished, failed, cancelled; who submitted it
EVENTS = "events.jsonl"  # run-level events: each attempt's start, notes, restarts, the end
RESULT = "result.pkl"  # the Result, pickled (a finished run)
ERROR = "error.pkl"  # the WorkerError, pickled (a failed run)
SUPERVISOR_LOG = "supervisor.log"  # the supervisor's own stdout and stderr
SUPERVISOR = "supervisor.json"  # the supervisor's pid and start time (common/session.py), or its SLURM job
SUMMARY = "summary.json"  # what `runs()` shows: devices, ranks, rank 0's last metrics (display/recorder.py)
STUDY = "study.db"  # a sweep's Optuna study (notebook/many/sweep_study.py)
PARTIAL = ".partial-"  # a run directory being written: .partial-PID-START-NAME, renamed into place when whole

ACTIVE = ("queued", "running", "restarting")
ENDED = ("finished", "failed", "cancelled")


def rank_events(rank: int | str) -> str:
    return f"rank-{rank}.jsonl"


def make_private_dir(path: Path, what: str) -> None:
    """Create `path` (0700); refuse a link, another user's directory, and one with anything in
    it (two runs never share), before anything is written there."""
    if os.path.lexists(path):
        check_own(path, what)
        if not path.is_dir() or any(path.iterdir()):
            raise FileExistsError(f"{what}={str(path)!r} exists and is not empty; give a new or empty directory.")
    private_dir(path)


def new_run_dir(base: Path, name: str, mode: int = 0o700) -> Path:
    """A new directory `base/<time>-<name>` (then -2, -3... for one made in the same second),
    each taken by an atomic mkdir: a submit and a tracked launch never share one."""
    make_parents(base / "run")
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
    for n in range(1, 1000):
        path = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir(mode=mode)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory named {stem}-N under {base}")


def partial_dir(parent: Path, name: str) -> Path:
    """A new private directory in `parent`, where a run directory is written before it is
    renamed into place: its name says whose it is, so one its writer left is known as stale."""
    me = session.identity(os.getpid())
    make_parents(parent / "run")
    path = parent / f"{PARTIAL}{me['pid']}-{me['start']}-{name}"
    shutil.rmtree(path, ignore_errors=True)  # our own pid's, from before a reboot
    return private_dir(path, exist_ok=False)


def place(partial: Path, final: Path) -> None:
    """Rename the whole run directory `partial` to `final`: a new name, or an empty directory
    of ours (`new_run_dir`'s, or one the user gave), which it replaces."""
    try:
        os.rename(partial, final)
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise FileExistsError(f"run_dir={str(final)!r} was filled while the run was written; give a new or "
                                  "empty directory.") from None
        raise


def writer_gone(partial: Path) -> bool:
    """Whether the writer a `.partial-PID-START-NAME` directory names has ended."""
    pid, start, *_ = partial.name[len(PARTIAL):].split("-", 2) + ["", ""]
    return not (pid.isdigit() and session.alive({"pid": int(pid), "start": start}))


def remove_stale_partials(parent: Path, name: str | None = None) -> list[str]:
    """Remove what interrupted submits left in `parent` (this user's partial directories whose
    writer has ended; of run directory `name` only, if given); the names removed."""
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(PARTIAL)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if name is not None and not entry.name.endswith(f"-{name}"):
            continue
        try:
            check_own(path)
        except OSError:  # another user's, or a link: not ours to remove
            continue
        if entry.is_dir(follow_symlinks=False) and writer_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` to `path` as a whole, 0600 (`private.write_private`): IncompleteWrite if not."""
    write_private(path, data)


def write_json(path: Path, value: dict) -> None:
    write_whole(path, json.dumps(value, indent=1).encode())


JSON_LIMIT = 16 << 20  # bytes: a run's JSON files are small; a larger one is damaged, not read into memory


def read_json(path: Path, *keys: str) -> dict:
    """A run file's JSON object, read as `private.read_own` reads; one that is damaged, or lacks
    one of `keys`, or is larger than any nbtrain writes, is a ValueError naming the file."""
    value = read_own_json(path, limit=JSON_LIMIT)
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} is damaged: it holds {type(value).__name__} {_short(value)}, not an object")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ValueError(f"{str(path)!r} is damaged: it has no {', '.join(map(repr, missing))}")
    return value


def write_spec(path: Path, value: dict) -> None:
    """run.json, with the version of the run directory's formats (`protocol.VERSION`)."""
    write_json(path, protocol.spec(value))


def read_spec(path: Path, *keys: str) -> dict:
    """run.json as this version reads it (`protocol.read_spec` upgrades an older one)."""
    return protocol.read_spec(read_json(path, *keys), str(path))


class _Unpickler(dill.Unpickler):
    """Finds the classes an older nbtrain's pickle names where they were then (`protocol.MOVED`)."""

    def find_class(self, module: str, name: str):
        moved = protocol.MOVED.get((module, name))
        return moved if moved is not None else super().find_class(protocol.MOVED_MODULES.get(module, module), name)


def read_pickle(path: Path):
    """A run file's pickle, read only from a file this user owns (`private.read_own`); one that
    cannot be unpickled is a ValueError naming the file, and why."""
    data = read_own(path)
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except Exception as error:  # truncated, overwritten, or a class this kernel cannot import
        raise ValueError(f"{str(path)!r} cannot be read back ({type(error).__name__}: {error}; "
                         f"{len(data):,} bytes)") from error


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def metric_name(name) -> str:
    """A metric's name as a table shows it: a name that is not a string (a tuple, written to the
    log as a JSON list) by its repr as a tuple."""
    if isinstance(name, str):
        return name
    return repr(tuple(name)) if isinstance(name, (list, tuple)) else repr(name)


class EventLog:
    """Appends a log's events (`protocol` records), each as one whole line; a new log begins with
    the header that names its format's version."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if os.fstat(self.fd).st_size == 0:  # a restart's attempt appends to the log its first began
            try:
                self._write(protocol.header_line())
            except OSError:
                self.close()
                raise

    def write(self, attempt: int, event) -> None:
        """One line; IncompleteWrite if the disk takes only part of it (the line stays cut and
        unread: `Tail` skips it)."""
        self._write(protocol.event_line(attempt, event))

    def _write(self, data: bytes) -> None:
        # One write call per line: O_APPEND puts it at the end whole, even with other writers.
        wrote = 0
        try:
            while wrote < len(data):  # a full disk takes part of a write, then fails the rest
                wrote += os.write(self.fd, data[wrote:])
        except OSError as error:
            raise IncompleteWrite(self.path, error, wrote, len(data)) from error

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Tail:
    """Reads the events appended to a log since the last read, as `protocol.Logged` records of
    whatever version the log is; a partial last line waits. Only a file this user owns, reached
    through no link, is read (`private.read_own`)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self.version = 1  # until the first line says otherwise: version 1 had no header

    def read(self) -> list[protocol.Logged]:
        try:
            data = read_own(self.path, self.offset)
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        first, self.offset = self.offset == 0, self.offset + end
        events = []
        for line in data[:end].splitlines():
            try:
                value = json.loads(line)
            except ValueError:  # a line cut by a full disk: skip it, keep the rest
                continue
            if first:
                first = False
                version = protocol.log_version(value)
                if version is not None:
                    self.version = version
                    continue
            event = protocol.read_event(value, self.version)
            if event is not None:  # anything else is not ours
                events.append(event)
        return events


BACKWARDS_CHUNK = 1 << 16  # bytes read at a time by `last_events`, from the end of a log


def last_events(path: Path, count: int, kind: type | tuple[type, ...]) -> list[protocol.Logged]:
    """The last `count` events of `kind` in the log at `path`, oldest first, read backwards from
    its end: time and memory go with what is asked for, not with the log's size (a log of a
    gigabyte shows its last lines at once). Read as `Tail` reads: a cut or foreign line is skipped."""
    try:
        fd = open_own(path)
    except FileNotFoundError:
        return []
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, min(size, 4096), 0)
        try:  # the header names the log's version; a log without one is version 1
            version = protocol.log_version(json.loads(head.split(b"\n", 1)[0])) or 1
        except ValueError as error:
            if "format" in str(error):  # a newer nbtrain's log: said, as Tail says it
                raise
            version = 1
        found: list[protocol.Logged] = []
        end, carry = size, b""
        while end > 0 and len(found) < count:
            start = max(0, end - BACKWARDS_CHUNK)
            lines = (os.pread(fd, end - start, start) + carry).split(b"\n")
            if end == size:
                lines.pop()  # after the last newline: nothing, or a line still being written
            carry = lines.pop(0) if start > 0 else b""  # its beginning lies in the chunk before
            for line in reversed(lines):
                event = _event(line, version)
                if event is not None and isinstance(event.event, kind):
                    found.append(event)
                    if len(found) == count:
                        break
            end = start
        return found[::-1]
    finally:
        os.close(fd)


def _event(line: bytes, version: int) -> protocol.Logged | None:
    try:
        value = json.loads(line)
        if protocol.log_version(value) is not None:  # the header
            return None
    except ValueError:  # a line cut by a full disk, a header not in its place
        return None
    return protocol.read_event(value, version)
