"""`Run`: a submitted run, followed through its directory from any kernel (`attach`). Where it
stands is `run_status.py`'s reading, what its logs say `run_logs.py`'s, its live view
`follow.py`'s, the table of runs under a folder `listing.py`'s.

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

from ...common import runlog, session, wake
from ...display import check_progress, in_jupyter, make_display
from ...display.widgets import WidgetDisplay
from ..run import steer_files
from ..run.result import Result
from ..run.steering import Steering
from . import run_logs
from .follow import Follower
from .run_status import current_status, own_run_dir, read_status, say_cancelled, submitting, supervisor_of

POLL = 0.2  # seconds between looks at the run directory
BACKSTOP = 2.0  # ... while waiting for its end, where a change wakes the waiter
START_WAIT = 60.0  # seconds a Run shown in a cell waits for its ranks to start (the supervisor imports torch)
SUBMIT_WAIT = 10.0  # seconds cancel() waits for the supervisor of a run still being submitted to be recorded


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
        self.dir, self.progress = own_run_dir(run_dir), progress
        path = self.dir / runlog.SPEC
        self.spec = runlog.read_spec(path, "function", "started", "max_restarts", "launch")
        if not isinstance(self.spec["started"], (int, float)) or not isinstance(self.spec["launch"], dict):
            raise ValueError(f"{str(path)!r} is damaged: its 'started' is not a time or its 'launch' not an object")
        self._watcher: threading.Thread | None = None

    # -- where it stands -----------------------------------------------------------------
    def _status(self) -> dict:
        return current_status(self.dir)

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
                who = supervisor_of(self.dir)
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
        who = supervisor_of(self.dir)
        if who is None:
            # Being submitted: said cancelled first, so a supervisor that starts from now on
            # leaves at once; then one recorded meanwhile is stopped.
            say_cancelled(self.dir, self.spec["max_restarts"])
            deadline = time.monotonic() + SUBMIT_WAIT
            while (who := supervisor_of(self.dir)) is None and time.monotonic() < deadline and submitting(self.dir):
                time.sleep(POLL)
        if who is not None and "slurm_job" in who:
            session.stop_slurm_job(who["slurm_job"])
        elif who is not None and session.alive(who):
            session.stop(who["pid"])
        try:
            ended = read_status(self.dir)["status"] in runlog.ENDED
        except ValueError:
            ended = False
        if not ended:  # it died before saying so
            say_cancelled(self.dir, self.spec["max_restarts"])

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
        ranks = run_logs.ranks_of(self.dir)
        if ranks and rank not in ranks:
            raise ValueError(f"logs(rank={rank}): the run has rank{'s' if len(ranks) > 1 else ''} "
                             f"{', '.join(map(str, ranks))}.")
        return run_logs.printed(self.dir, rank, last)

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
        return export(fn, *args, to=path, devices=options["devices"], accelerator=options["accelerator"],
                      num_nodes=options["num_nodes"], changes=run_logs.last_changes(self.dir), **kwargs)

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
        if self.spec.get("kind") != "sweep":
            return shown
        return shown + "".join(f"\n  {line}" for line in run_logs.sweep_trials(self.dir))


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
