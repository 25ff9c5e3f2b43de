"""`Run`: a submitted run, followed through its directory from any kernel (`attach`); its live
view is `follow.py`'s, the table of runs under a folder `listing.py`'s.

Everything here reads the run directory (`common/runlog.py`); nothing talks to the run's
processes except `cancel`, which stops its session. The live view feeds the events to a
`RunState`, so it is the same view `launch` draws.

What is read back is this user's own: a run directory of another user, or one reached through a
symbolic link, is refused before any of it is read, and each file is read only if it is ours
(`common/private.py`): a pickle in someone else's file would run their code as you. A damaged
or impossible file is an error naming the file and the run, at once, never a wait.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from ...common import protocol, runlog, session, wake
from ...common.private import check_own
from ...display import check_progress, in_jupyter, make_display
from ...display.widgets import WidgetDisplay
from ..run import steer_files
from ..run.result import Result
from ..run.steering import Steering
from .follow import Follower

POLL = 0.2  # seconds between looks at the run directory
BACKSTOP = 2.0  # ... while waiting for its end, where a change wakes the waiter
START_WAIT = 60.0  # seconds a Run shown in a cell waits for its ranks to start (the supervisor imports torch)
SUBMIT_WAIT = 10.0  # seconds cancel() waits for the supervisor of a run still being submitted to be recorded
STATUSES = (*runlog.ACTIVE, *runlog.ENDED)
SUMMARY_METRICS = 1000  # the last metric events a run without summary.json is summed up from


def _run_dir(run_dir) -> Path:
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


def _check_timeout(timeout, call: str):
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):  # nan too
        raise ValueError(f"{call}(timeout={timeout!r}): give the seconds to wait (a number, 0 or more), or None "
                         "to wait until the run ends.")


class Run(Steering):
    """A run that outlives the kernel: returned by `submit`, found again by `attach`.

    Everything is read back from the run's directory, so a Run works from any later kernel.
    Shown as a cell's value in Jupyter, it draws the run's live view (as `launch` does) until
    the run ends; elsewhere its repr.

    Parameters
    ----------
    run_dir : str or Path
        The run's directory.
    progress : bool or str, default True
        How it draws itself, as ``launch(progress=...)``.

    Raises
    ------
    ValueError
        ``run_dir`` is not a run directory, or is damaged (named with the file).
    PermissionError
        ``run_dir`` is another user's, or reached through a symbolic link.
    """

    def __init__(self, run_dir, progress=True):
        self.dir, self.progress = _run_dir(run_dir), progress
        path = self.dir / runlog.SPEC
        self.spec = runlog.read_spec(path, "function", "started", "max_restarts", "launch")
        if not isinstance(self.spec["started"], (int, float)) or not isinstance(self.spec["launch"], dict):
            raise ValueError(f"{str(path)!r} is damaged: its 'started' is not a time or its 'launch' not an object")
        self._watcher: threading.Thread | None = None

    # -- where it stands -----------------------------------------------------------------
    def _read_status(self) -> dict:
        path = self.dir / runlog.STATUS
        try:
            value = runlog.read_json(path, "status")
        except FileNotFoundError:
            raise ValueError(f"{str(path)!r} is gone: the run directory was changed by something else than "
                             "nbtrain") from None
        if value["status"] not in STATUSES:
            raise ValueError(f"{str(path)!r} is damaged: its status {value['status']!r} is none of "
                             f"{', '.join(STATUSES)}")
        return value

    def _supervisor(self) -> dict | None:
        """Who supervises the run (supervisor.json); None if it was never recorded."""
        return self._identity(self.dir / runlog.SUPERVISOR, None)

    @staticmethod
    def _identity(path: Path, value) -> dict | None:
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

    def _status(self) -> dict:
        value = self._read_status()
        if value["status"] not in runlog.ACTIVE:
            return value
        who = self._supervisor()
        if who is None:
            if value["status"] != "queued":  # the supervisor records itself before it says anything else
                raise ValueError(f"{str(self.dir / runlog.STATUS)!r} says the run is {value['status']}, but there is "
                                 f"no {runlog.SUPERVISOR}: its supervisor cannot be found (the run directory is "
                                 "damaged)")
            submitter = value.get("submitter")
            if submitter is not None and session.alive(self._identity(self.dir / runlog.STATUS, submitter)):
                return value  # still being submitted
            who = self._supervisor()  # read again: it may have been recorded just now
            if who is None:
                value = self._read_status()  # submit may have said why
                if value["status"] in runlog.ACTIVE:
                    whom = f"(pid {submitter['pid']}) " if submitter else ""
                    value.update(status="failed", reason=f"the run never started: the kernel that submitted it "
                                                         f"{whom}ended before the run's supervisor started")
                return value
        if not session.alive(who):  # read again: it may have written its end just before exiting
            value = self._read_status()
            if not session.alive(who) and value["status"] in runlog.ACTIVE:
                whom = f"SLURM job {who['slurm_job']}" if "slurm_job" in who else f"pid {who['pid']}"
                said = self._last_words()
                value.update(status="failed", reason=f"the run's supervisor ({whom}) ended without finishing it"
                                                     f"{': ' + said if said else ''}; see "
                                                     f"{self.dir / runlog.SUPERVISOR_LOG}")
        return value

    def _last_words(self) -> str:
        """The supervisor's last line of its own in supervisor.log (why it ended, if it could say)."""
        try:
            tail = runlog.read_own(self.dir / runlog.SUPERVISOR_LOG, -4096).decode(errors="replace")
        except OSError:
            return ""
        said = [line[len("nbtrain: "):] for line in tail.splitlines() if line.startswith("nbtrain: ")]
        return said[-1] if said else ""

    @property
    def status(self) -> str:
        """Where the run stands: 'queued', 'running', 'restarting', 'finished', 'failed' or 'cancelled'."""
        return self._status()["status"]

    @property
    def reason(self) -> str:
        """Why it failed, was cancelled, or is restarting ("" otherwise)."""
        return self._status().get("reason", "")

    @property
    def restarts(self) -> list[str]:
        """Why each restart happened, one line each."""
        return list(self._status().get("restarts", []))

    @property
    def function(self) -> str:
        """The name of the function the run runs ('cell' for a ``%%nbtrain --submit`` cell)."""
        return self.spec["function"]

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the run ends.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; None: as long as it takes.

        Returns
        -------
        str
            Its status: 'finished', 'failed' or 'cancelled'.

        Raises
        ------
        TimeoutError
            It is still running after ``timeout`` seconds.
        ValueError
            ``timeout`` is not a positive number, or the run directory is damaged.
        """
        _check_timeout(timeout, "wait")
        return self._wait(timeout)

    def _wait(self, timeout: float | None) -> str:
        """Woken by the run's end (status.json renamed into place) or its supervisor's death,
        where the machine tells (`wake.Changes`); a look every `BACKSTOP` s all the same (a
        SLURM supervisor, a submitter that died before its supervisor started), or every
        `POLL` s where nothing tells."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if (status := self.status) in runlog.ENDED:  # no watch to set up (closing an inotify one takes ms)
            return status
        watched = None
        with wake.Changes(self.dir) as changes:
            while (status := self.status) not in runlog.ENDED:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"the run in {self.dir} is still {status} after {timeout} s.")
                who = self._supervisor()
                if who is not None and "pid" in who and who["pid"] != watched:
                    watched = who["pid"]
                    changes.watch_process(watched)  # then looked at again: still the process `who` names
                    continue
                backstop = BACKSTOP if changes.woken else POLL
                changes.wait(backstop if deadline is None else min(backstop, deadline - now))
        return status

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end and return what the run gave back.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; None: as long as it takes.

        Returns
        -------
        Result
            As `launch` returns it; ``restarts`` says why each restart happened.

        Raises
        ------
        WorkerError
            The run failed: its error, as `launch` would have raised it.
        RuntimeError
            It was cancelled, or failed without an error to raise (the reason says why).
        TimeoutError
            It is still running after ``timeout`` seconds.
        ValueError
            ``timeout`` is not a positive number, or the run directory is damaged.
        """
        _check_timeout(timeout, "result")
        status = self._wait(timeout)
        if status == "finished":
            if not os.path.lexists(self.dir / runlog.RESULT):
                raise ValueError(f"the run in {self.dir} finished but has no {runlog.RESULT}: it was removed")
            return runlog.read_pickle(self.dir / runlog.RESULT)
        if status == "cancelled":
            raise RuntimeError(f"the run in {self.dir} was cancelled; it has no result.")
        if os.path.lexists(self.dir / runlog.ERROR):
            raise runlog.read_pickle(self.dir / runlog.ERROR)
        raise RuntimeError(f"the run in {self.dir} failed: {self.reason}")

    # -- steering (a run of rank processes on this machine: `steer_files.py`) ------------------
    def _steered(self, method: str, timeout: float | None, *args, **kwargs):
        """Steering through the run directory (`steer_files`), from any kernel: a RuntimeError when
        the run cannot be steered (it ended, has not started its ranks, runs on a cluster or in one
        process)."""
        return steer_files.ask(self.dir, lambda: self.status in runlog.ENDED, method, *args, timeout=timeout,
                               **kwargs)

    def cancel(self) -> None:
        """Stop the run: its ranks stop as a Ctrl-C stops a launch, and nothing of its processes is left.

        A run that has ended stays as it is. With SLURM, its jobs are cancelled (``scancel``).

        Returns
        -------
        None
        """
        try:
            if self._status()["status"] in runlog.ENDED:
                return
        except ValueError:  # a damaged status: what it names is stopped all the same
            pass
        who = self._supervisor()
        if who is None:
            # Being submitted: said cancelled first, so a supervisor that starts from now on
            # leaves at once; then one recorded meanwhile is stopped.
            self._cancelled()
            deadline = time.monotonic() + SUBMIT_WAIT
            while (who := self._supervisor()) is None and time.monotonic() < deadline and self._submitting():
                time.sleep(POLL)
        if who is not None and "slurm_job" in who:
            session.stop_slurm_job(who["slurm_job"])
        elif who is not None and session.alive(who):
            session.stop(who["pid"])
        try:
            ended = self._read_status()["status"] in runlog.ENDED
        except ValueError:
            ended = False
        if not ended:  # it died before saying so
            self._cancelled()

    def _submitting(self) -> bool:
        submitter = self._read_status().get("submitter")
        return submitter is not None and session.alive(self._identity(self.dir / runlog.STATUS, submitter))

    def _cancelled(self) -> None:
        try:
            value = self._read_status()
        except ValueError:  # damaged: written anew
            value = {"restarts": [], "max_restarts": self.spec["max_restarts"]}
        value.update(status="cancelled", reason="cancelled by Run.cancel()", ended=time.time())
        runlog.write_json(self.dir / runlog.STATUS, value)

    def _summary(self, from_logs: bool = True) -> dict:
        """devices, ranks and rank 0's last metrics: summary.json (the supervisor's recorder
        keeps it), or for a run written before it was (or before its first), the logs."""
        path = self.dir / runlog.SUMMARY
        try:
            summary = runlog.read_json(path, "devices", "ranks", "metrics")
        except FileNotFoundError:
            if not from_logs:
                raise
            return self._summary_from_logs()
        if not isinstance(summary["metrics"], dict) or not isinstance(summary["ranks"], list):
            raise ValueError(f"{str(path)!r} is damaged: its metrics or ranks are not what the recorder writes")
        return summary

    def _summary_from_logs(self) -> dict:
        summary: dict[str, Any] = {"devices": "", "ranks": [], "metrics": {}}
        # Read from the logs' ends: the last attempt's start, the latest metrics (a bounded number
        # of them, so a huge log costs no more than a small one).
        for _, event in runlog.last_events(self.dir / runlog.EVENTS, 1, protocol.AttemptStarted):
            if isinstance(event.title, str) and isinstance(event.ranks, list):
                summary.update(devices=event.title.split(" on ", 1)[-1], ranks=event.ranks)
        for _, event in runlog.last_events(self.dir / runlog.rank_events(0), SUMMARY_METRICS, protocol.Metric):
            summary["metrics"][runlog.metric_name(event.name)] = event.value
        return summary

    def logs(self, rank: int = 0, last: int | None = None) -> str:
        """What a rank printed, every attempt's, as text.

        Parameters
        ----------
        rank : int, default 0
            The rank.
        last : int, optional
            Only the last this many lines, read from the log's end (quick whatever its size).

        Returns
        -------
        str

        Raises
        ------
        ValueError
            The run has no such rank.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"logs(rank={rank!r}): give a rank number (0 is the first).")
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"logs(last={last!r}): give a number of lines, 0 or more.")
        ranks = self._ranks()
        if ranks and rank not in ranks:
            raise ValueError(f"logs(rank={rank}): the run has rank{'s' if len(ranks) > 1 else ''} "
                             f"{', '.join(map(str, ranks))}.")
        path = self.dir / runlog.rank_events(rank)
        if last is not None:
            lines = [event.text for _, event in runlog.last_events(path, last, protocol.Output)]
        else:
            lines = [event.text for _, event in runlog.Tail(path).read() if isinstance(event, protocol.Output)]
        return "".join(f"{line}\n" for line in lines)

    def _ranks(self) -> list:
        """The run's ranks: from summary.json, or where that is damaged or missing, from the
        last attempt's start in the run's log (read from its end)."""
        try:
            return self._summary(from_logs=False)["ranks"]
        except (ValueError, OSError):
            started = runlog.last_events(self.dir / runlog.EVENTS, 1, protocol.AttemptStarted)
            ranks = started[0].event.ranks if started else []
            return ranks if isinstance(ranks, list) else []

    def export(self, path) -> Path:
        """This run's job as a directory that runs with no notebook, as `export` writes it.

        Parameters
        ----------
        path : str or Path
            A new directory for the job.

        Returns
        -------
        Path
            The directory: ``bash run.sh`` or ``sbatch sbatch.sh`` there.

        Raises
        ------
        ValueError
            The run keeps no job of its own (an exported job's run), or it cannot be read back.
        """
        from .export import export, load_job  # torch: `nbtrain runs` and `attach` list and follow runs without it

        job = self.dir / runlog.JOB
        if not os.path.lexists(job):
            raise ValueError(f"{self.dir} was run by an exported job's run.sh, which keeps no job of its own: "
                             f"the exported directory ({self.dir.parent}) is the job; copy it instead.")
        data = runlog.read_own(job)
        try:
            fn, args, kwargs = load_job(data)
        except Exception as error:
            raise ValueError(f"{str(job)!r} cannot be read back ({type(error).__name__}: {error}; "
                             f"{len(data):,} bytes)") from error
        options = self.spec["launch"]
        logged = runlog.Tail(self.dir / runlog.EVENTS).read()
        last = max((attempt for attempt, _ in logged), default=None)  # a restart's changes, not its first attempt's
        changes = [e for a, e in logged if a == last and isinstance(e, protocol.Change)]
        return export(fn, *args, to=path, devices=options["devices"], accelerator=options["accelerator"],
                      num_nodes=options["num_nodes"], changes=changes, **kwargs)

    # -- the live view -------------------------------------------------------------------
    def watch(self, progress=None, output: bool = True) -> str:
        """Show the run as `launch` does, until it ends; Ctrl-C stops watching, not the run.

        Parameters
        ----------
        progress : bool or str, optional
            As for `launch`; default the Run's own (given to `submit` or `attach`).
        output : bool, default True
            Show what the ranks print, too.

        Returns
        -------
        str
            Its status when the watching stopped.
        """
        follower = Follower(self.dir, make_display(self.progress if progress is None else progress), output)
        try:
            while not follower.poll(self._status()):
                time.sleep(POLL)
        except KeyboardInterrupt:
            follower.display.note(f"stopped watching; the run goes on ({self.dir})")
        return self.status

    def _ipython_display_(self) -> None:
        display = make_display(self.progress)
        if self.spec.get("kind") == "sweep" or not in_jupyter() or not isinstance(display, WidgetDisplay):
            # lines would print into later cells; a sweep's table is its study's, read when shown
            print(repr(self))
            return
        # Drawn by a thread, so the cell returns at once; rank output stays in logs(rank),
        # since a thread's prints would land in whichever cell runs then.
        follower = Follower(self.dir, display, output=False)
        deadline = time.monotonic() + START_WAIT  # the view is shown here, in this cell, once the ranks start
        while not follower.poll(self._status()) and follower.state is None and time.monotonic() < deadline:
            time.sleep(POLL)
        if follower.state is None and not follower.done:
            print(f"{self!r}: not started after {START_WAIT:.0f} s; show it again, or run.watch().")
            return

        def follow() -> None:
            try:
                while not follower.poll(self._status()):
                    time.sleep(POLL)
            except (ValueError, OSError) as error:  # a damaged run directory: said in the view, not in a later cell
                display.note(f"stopped following the run: {error}")

        self._watcher = threading.Thread(target=follow, name="nbtrain-run-view", daemon=True)
        self._watcher.start()

    def __repr__(self) -> str:
        try:
            status = self.status
        except (ValueError, OSError):  # said by .status itself; a repr stays a repr
            status = "damaged"
        shown = f"Run({str(self.dir)!r}, function={self.function!r}, status={status!r})"
        return shown + "".join(f"\n  {line}" for line in self._trials()) if self.spec.get("kind") == "sweep" else shown

    def _trials(self) -> list[str]:
        """A submitted sweep's trials as its study holds them, a line each (none before it began)."""
        path = self.dir / runlog.STUDY
        if not path.exists():
            return []
        try:
            check_own(path, "study database")
            import optuna  # only for a sweep, which needed it to run
            from sqlalchemy.pool import NullPool

            storage = optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"poolclass": NullPool})
            study = optuna.load_study(study_name=None, storage=storage)
            trials = study.get_trials(deepcopy=False)
        except Exception as error:  # a study still being made, or damaged: said, never raised from a repr
            return [f"(the study cannot be read now: {type(error).__name__}: {error})"]
        return [f"trial {t.number}  {t.state.name.lower()}  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                                         f"{k}={v}" for k, v in t.params.items())
                + ("" if t.value is None else f"  value={t.value:.4g}") for t in trials]


def attach(run_dir, progress=True) -> Run:
    """A submitted run again, from any kernel: its status, live view, result, logs, cancel.

    Only a run directory of your own, not reached through a symbolic link, is read.

    Parameters
    ----------
    run_dir : str or Path
        The run's directory (`runs` lists them).
    progress : bool or str, default True
        How the Run draws itself, as ``launch(progress=...)``.

    Returns
    -------
    Run

    Raises
    ------
    ValueError
        ``run_dir`` is not a run directory, or is damaged (named with the file), or ``progress``
        is not a progress setting.
    PermissionError
        ``run_dir`` is another user's, or reached through a symbolic link.
    """
    check_progress(progress)
    return Run(run_dir, progress)
