"""Where a sweep's trials are kept, and how an interrupted sweep goes on: Optuna's study.

`open_study` gives the sweep its study: one the user made, one at a storage URL, or by default
SQLite in the sweep's run directory (private to the user; `nbtrain-runs/sweep-<fn>`, the same for
the same function, so running the cell again finds it). `resume` makes a study an interrupted
sweep left ready to go on. nbtrain marks only its own trials, with user attributes: the kernel
that runs a trial, its slot, why it failed, and whether Ctrl-C stopped it.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from ..common import runlog
from ..common.private import check_own, private_dir
from .insight import RUNS, _name, check_run_dir

KERNEL = "nbtrain_kernel"  # user attributes nbtrain sets on a trial: the kernel that runs it ("host:pid"),
INTERRUPTED = "nbtrain_interrupted"  # ... that it was stopped by Ctrl-C (resumed: run again),
RETRY_OF = "nbtrain_retry_of"  # ... the interrupted trial it runs again,
SLOT = "nbtrain_slot"  # ... where it ran,
ERROR = "nbtrain_error"  # ... and, when it failed, the first line and the traceback (its end)
TRACEBACK = "nbtrain_traceback"
TRACEBACK_CHARS = 8000  # an Optuna attribute is a database row: the traceback's end is kept


def this_kernel() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def open_study(optuna, study, fn, *, direction, sampler, pruner, metric: str, run_dir):
    """(the study, its run directory or None): the one given, one at a storage URL, or SQLite in run_dir."""
    if study is not None and not isinstance(study, (str, optuna.Study)):
        raise ValueError(f"study={study!r}: give an optuna.Study, a storage URL ('sqlite:///path/study.db', "
                         "'postgresql://...'), or None for a study in the sweep's run directory.")
    if isinstance(study, optuna.Study):
        for name, given in (("sampler", sampler), ("pruner", pruner)):
            if given is not None:
                raise ValueError(f"{name}={given!r} with study=: a study keeps its own {name}; give it to "
                                 f"optuna.create_study(..., {name}=...) instead.")
    else:
        storage, run_dir = (study, None) if isinstance(study, str) else _study_file(optuna, fn, run_dir)
        try:
            study = optuna.create_study(storage=storage, study_name=_name(fn), direction=direction or "minimize",
                                        sampler=sampler, pruner=pruner, load_if_exists=True)
        except ValueError as exc:  # an existing study whose direction differs, a bad URL
            where = f"run_dir={run_dir!r}" if run_dir else f"study={storage!r}"
            raise ValueError(f"{where}: {exc}. Give another run_dir (or study=) for a new sweep.") from None
    if len(study.directions) != 1:
        raise ValueError("study= has several objectives; nbtrain.sweep optimises one metric.")
    held = study.direction.name.lower()
    if direction is not None and direction != held:
        raise ValueError(f"direction={direction!r}, but the study {study.study_name!r} is set to {held!r}.")
    known = study.user_attrs.get("nbtrain_metric")
    if known not in (None, metric):
        raise ValueError(f"metric={metric!r}, but the study {study.study_name!r} optimises {known!r}"
                         + (f" (run_dir={run_dir!r}: give another run_dir for a new sweep)." if run_dir else "."))
    if known is None:
        study.set_user_attr("nbtrain_metric", metric)
    return study, run_dir


def _study_file(optuna, fn, run_dir):
    """(Optuna's storage, the run directory): SQLite in the run directory (0700; the database 0600).
    The default sweep of `fn` is always the same directory, nbtrain-runs/sweep-<fn>, so running the
    cell again resumes it. No connection is kept open between uses (a kernel holds no file of a
    finished sweep), and a busy database is waited for, not an error: slots write to it at once."""
    directory = Path(check_run_dir(run_dir) if run_dir is not None else Path(RUNS) / f"sweep-{_name(fn)}").absolute()
    private_dir(directory)
    path = directory / runlog.STUDY
    try:  # made 0600 before SQLite opens it (its journal files take the database's mode)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        check_own(path, "study database")
    from sqlalchemy.pool import NullPool

    storage = optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={
        "poolclass": NullPool, "connect_args": {"timeout": 60}})
    return storage, str(directory)


def _running_elsewhere(trial) -> bool:
    """A running trial that a live kernel (not this one) may still be running: left alone."""
    owner = trial.user_attrs.get(KERNEL, "")
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's, or not nbtrain's: not ours to end
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
