"""Where a sweep's trials are kept, and how an interrupted sweep goes on: Optuna's study.

`open_study` gives the sweep its study: one the user made, one at a storage URL, or by default
SQLite in the sweep's run directory (private to the user; `nbtrain-runs/sweep-<fn>-<key>`, the
key made from the objective's code and space: the same objective finds it again when the cell
runs again, another never resumes it). A sweep holds its study for as long as it runs: a second
sweep of the same study (another kernel) is refused, with the first's owner named; resuming is
said in one line before anything runs. `resume` makes a study an interrupted sweep left ready to
go on. nbtrain marks only its own trials, with user attributes: the kernel that runs a trial
(host, pid and the process's start time, so a reused pid is not mistaken for it), its slot, why
it failed, and whether Ctrl-C stopped it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import inspect
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ...common import runlog
from ...common.private import check_own, private_dir
from ..run.insight import RUNS, check_run_dir

log = logging.getLogger(__name__)

KERNEL = "nbtrain_kernel"  # user attributes nbtrain sets on a trial: the kernel that runs it ("host:pid:start"),
INTERRUPTED = "nbtrain_interrupted"  # ... that it was stopped by Ctrl-C (resumed: run again),
RETRY_OF = "nbtrain_retry_of"  # ... the interrupted trial it runs again,
SLOT = "nbtrain_slot"  # ... where it ran, the most GPU memory it held (bytes; on a GPU),
GPU_MEMORY = "nbtrain_gpu_memory"
ERROR = "nbtrain_error"  # ... and, when it failed (or its value was nan), why, and the traceback (its end)
TRACEBACK = "nbtrain_traceback"
TRACEBACK_CHARS = 8000  # an Optuna attribute is a database row: the traceback's end is kept
OBJECTIVE = "nbtrain_objective"  # the study's user attribute: the key of the objective that made it
LOCK = "sweep.lock"  # in the run directory: held (flock) by the one sweep running the study
FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:  # another user's: alive, its start unknown
        return -1.0


def this_kernel() -> str:
    """This process as a trial's owner, "host:pid:start" (read once per process, not at every
    trial: its start time is a look at /proc)."""
    return _kernel(os.getpid())


@functools.cache
def _kernel(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def study_name(fn) -> str:
    """The study's name: the objective's (a partial's function's; 'lambda' for a lambda)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    name = "lambda" if name == "<lambda>" else name
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "objective"


def objective_key(fn, space) -> str:
    """What the objective is, in 10 hex digits: its compiled code (not its source file, which may
    have changed since, nor its line: the same code elsewhere is the same objective) and the space.
    A partial's bound arguments are left out (a path, an object's repr, would differ)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)  # a callable object
    what = _code_text(code) if code is not None else getattr(type(fn), "__qualname__", "")
    space_text = repr(sorted((k, repr(v)) for k, v in (space or {}).items()))
    return hashlib.sha256(f"{what}\0{space_text}".encode()).hexdigest()[:10]


def _code_text(code) -> str:
    """A code object as text that is the same in every process: nested code (a lambda, a comprehension)
    by its own text, not by its repr, which holds an address."""
    consts = [_code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return repr((code.co_code.hex(), consts, code.co_names, code.co_varnames))


@dataclass
class Opened:
    study: object
    run_dir: str | None  # where nbtrain keeps the study; None: the user's study or storage
    said: str | None  # the line saying what the sweep resumes, if it does
    lock: int | None  # the run directory's lock, held while the sweep runs; `close()` lets it go

    def close(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def open_study(optuna, study, fn, *, space, direction, sampler, pruner, metric: str | None, run_dir) -> Opened:
    """The sweep's study: the one given, one at a storage URL, or SQLite in run_dir (held: see `_hold`)."""
    if study is not None and not isinstance(study, (str, optuna.Study)):
        raise ValueError(f"study={study!r}: give an optuna.Study, a storage URL ('sqlite:///path/study.db', "
                         "'postgresql://...'), or None for a study in the sweep's run directory.")
    key, lock, made = objective_key(fn, space), None, False
    if isinstance(study, optuna.Study):
        for name, given in (("sampler", sampler), ("pruner", pruner)):
            if given is not None:
                raise ValueError(f"{name}={given!r} with study=: a study keeps its own {name}; give it to "
                                 f"optuna.create_study(..., {name}=...) instead.")
    else:
        storage, path = study, None
        if not isinstance(study, str):
            run_dir = str(Path(check_run_dir(run_dir) if run_dir is not None
                               else Path(RUNS) / f"sweep-{study_name(fn)}-{key}").absolute())
            lock = _hold(Path(run_dir))
            path, made = _study_file(Path(run_dir))
        where = f"run_dir={run_dir!r}" if run_dir else f"study={storage!r}"
        try:
            if path is not None:
                storage = _storage(optuna, path)
            with _quiet(optuna):  # Optuna's "A new study created in RDB" line
                study = optuna.create_study(storage=storage, study_name=study_name(fn),
                                            direction=direction or "minimize", sampler=sampler, pruner=pruner,
                                            load_if_exists=True)
        except Exception as exc:
            if lock is not None:
                os.close(lock)
            if made and path is not None:  # nothing of a study that could not be made is left behind
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if _disk_full(exc):
                raise RuntimeError(f"{where}: the sweep's study cannot be written there: the disk is full (or a "
                                   "file-size limit was reached). Free some space, or give run_dir= (study=) "
                                   "elsewhere.") from None
            if isinstance(exc, ValueError):  # an existing study whose direction differs, a bad URL
                raise ValueError(f"{where}: {exc}. Give another run_dir (or study=) for a new sweep.") from None
            raise
    opened = Opened(study, run_dir, None, lock)
    try:
        _check(study, direction, metric, run_dir)
        if lock is None:
            _refuse_a_second(optuna, study)
        opened.said = _resuming(optuna, study, run_dir, key)
        if study.user_attrs.get(OBJECTIVE) != key:
            study.set_user_attr(OBJECTIVE, key)
    except BaseException:
        opened.close()
        raise
    return opened


def _check(study, direction, metric, run_dir) -> None:
    if len(study.directions) != 1:
        raise ValueError("study= has several objectives; nbtrain.sweep optimises one metric.")
    held = study.direction.name.lower()
    if direction is not None and direction != held:
        raise ValueError(f"direction={direction!r}, but the study {study.study_name!r} is set to {held!r}.")
    known = study.user_attrs.get("nbtrain_metric")
    if metric is not None and known not in (None, metric):
        raise ValueError(f"metric={metric!r}, but the study {study.study_name!r} optimises {known!r}"
                         + (f" (run_dir={run_dir!r}: give another run_dir for a new sweep)." if run_dir else "."))
    if known is None and metric is not None:
        study.set_user_attr("nbtrain_metric", metric)


def _resuming(optuna, study, run_dir, key) -> str | None:
    """One line when the study already holds trials: what is resumed, and whether by another objective."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING]
    if not trials:  # new, or only enqueued trials: nothing is resumed
        return None
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    held = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    where = f" in {run_dir}" if run_dir else ""
    other = study.user_attrs.get(OBJECTIVE)
    changed = (" Its trials were run by another objective (other code or space): give another run_dir for a "
               "new study." if other not in (None, key) else "")
    count = f"{len(trials)} trial{'s' if len(trials) > 1 else ''}"
    return f"nbtrain: resuming the study {study.study_name!r}{where}: {count} ({held}).{changed}"


def _hold(directory: Path) -> int:
    """The run directory made private and held for this sweep: a second sweep of its study (another
    kernel) is refused while this one runs. The lock goes with the process that holds it."""
    private_dir(directory)
    path = directory / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        check_own(path, "sweep lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another kernel"
        os.close(fd)
        raise RuntimeError(f"run_dir={str(directory)!r}: another sweep of this study is running ({owner}); two "
                           "sweeps at once would run more trials than asked, on more slots than there are. Wait for "
                           "it (or stop it), or give another run_dir.") from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # who holds it, for the next one's message; best effort (a full disk)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"kernel {this_kernel().rsplit(':', 1)[0]}".encode(), 0)
    return fd


def _refuse_a_second(optuna, study) -> None:
    """A study given (no run directory to hold): refused while a live kernel elsewhere runs trials of it."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    owners = sorted({t.user_attrs.get(KERNEL, "") for t in running if t.user_attrs.get(KERNEL)
                     and _running_elsewhere(t)})
    if owners:
        raise RuntimeError(f"the study {study.study_name!r} has trials running in another kernel "
                           f"({', '.join(o.rsplit(':', 1)[0] for o in owners)}): two sweeps at once would run more "
                           "trials than asked, on more slots than there are. Wait for it, or give another study.")


def _disk_full(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL:
            return True
        if "disk is full" in str(seen) or "disk I/O error" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def _quiet(optuna):
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _study_file(directory: Path) -> tuple[Path, bool]:
    """(the SQLite file in the run directory, whether it was made now): made 0600 before SQLite
    opens it (its journal files take the database's mode)."""
    path = directory / runlog.STUDY
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        return path, True
    except FileExistsError:
        check_own(path, "study database")
        return path, os.path.getsize(path) == 0  # an empty one a failed start left: nothing in it to keep


def _storage(optuna, path: Path):
    """Optuna's storage on the file. No connection is kept open between uses (a kernel holds no
    file of a finished sweep), and a busy database is waited for, not an error: slots write to it
    at once."""
    from sqlalchemy.pool import NullPool

    return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={
        "poolclass": NullPool, "connect_args": {"timeout": 60}})


def _running_elsewhere(trial) -> bool:
    """A running trial that a live kernel (not this one) may still be running: left alone. Its
    owner is the process with that pid *and* start time: a dead kernel whose pid lives on (a
    zombie) or was reused is not."""
    host, pid, start = _owner(trial.user_attrs.get(KERNEL, ""))
    if host != socket.gethostname() or pid is None:
        return True  # another machine's, or not nbtrain's: not ours to end
    if pid == os.getpid():
        return False
    now = _start_time(pid)
    if now is None:
        return False
    return start is None or now == -1.0 or abs(now - start) < 0.01


def _owner(text: str) -> tuple[str, int | None, float | None]:
    """(host, pid, start time) of a trial's owner: "host:pid:start" (or "host:pid", before nbtrain 0.5)."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        try:
            return parts[0], int(parts[1]), float(parts[2])
        except ValueError:
            return parts[0], int(parts[1]), None
    host, _, pid = text.rpartition(":")
    return host, int(pid) if pid.isdigit() else None, None


def resume(optuna, study) -> int:
    """Make an interrupted sweep's study ready to go on: trials a dead kernel left running are
    failed as interrupted, interrupted trials are enqueued again (once). Returns the trials that count
    as done (complete, pruned, failed by their own error)."""
    TrialState = optuna.trial.TrialState
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _running_elsewhere(trial):
            handle = optuna.trial.Trial(study, trial._trial_id)
            handle.set_user_attr(INTERRUPTED, True)
            study.tell(handle, state=TrialState.FAIL, skip_if_finished=True)
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    for trial in trials:
        if trial.state == TrialState.FAIL and trial.user_attrs.get(INTERRUPTED) and trial.number not in retried:
            study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
    return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and not t.user_attrs.get(INTERRUPTED)))
