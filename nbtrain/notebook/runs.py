"""`Run`: a submitted run, followed through its directory from any kernel (`attach`), and
`runs()`, the table of the runs under a folder.

Everything here reads the run directory (`common/runlog.py`); nothing talks to the run's
processes except `cancel`, which stops its session. The live view feeds the events to a
`RunState`, so it is the same view `launch` draws.
"""
from __future__ import annotations

import html
import threading
import time
from datetime import datetime
from pathlib import Path

import dill

from ..common import runlog, session
from ..display import check_progress, in_jupyter, make_display
from ..display.widgets import WidgetDisplay
from ..display.runstate import RunState, Vital
from .export import export, load_job
from .result import Result

POLL = 0.2  # seconds between looks at the run directory
START_WAIT = 60.0  # seconds a Run shown in a cell waits for its ranks to start (the supervisor imports torch)


class Run:
    """A run started by `nbtrain.submit`, or found again with `nbtrain.attach(run_dir)`."""

    def __init__(self, run_dir, progress=True):
        self.dir, self.progress = Path(run_dir).absolute(), progress
        missing = [name for name in (runlog.SPEC, runlog.STATUS) if not (self.dir / name).is_file()]
        if not self.dir.is_dir() or missing:
            what = "does not exist" if not self.dir.exists() else f"is not a run directory (no {', '.join(missing)})"
            raise ValueError(f"{str(run_dir)!r} {what}: give a directory made by nbtrain.submit (by default under "
                             "./nbtrain-runs/; nbtrain.runs() lists them).")
        self.spec = runlog.read_json(self.dir / runlog.SPEC)
        self._watcher: threading.Thread | None = None

    # -- where it stands -----------------------------------------------------------------
    def _status(self) -> dict:
        value = runlog.read_json(self.dir / runlog.STATUS)
        supervisor = self.dir / runlog.SUPERVISOR
        if value["status"] in runlog.ACTIVE and supervisor.is_file():
            who = runlog.read_json(supervisor)
            if not session.alive(who):  # read again: it may have written its end just before exiting
                value = runlog.read_json(self.dir / runlog.STATUS)
            if not session.alive(who) and value["status"] in runlog.ACTIVE:
                whom = f"SLURM job {who['slurm_job']}" if "slurm_job" in who else f"pid {who['pid']}"
                value.update(status="failed", reason=f"the run's supervisor ({whom}) ended without "
                                                     f"finishing it; see {self.dir / runlog.SUPERVISOR_LOG}")
        return value

    @property
    def status(self) -> str:
        """queued, running, restarting, finished, failed or cancelled."""
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
        return self.spec["function"]

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the run ends (or `timeout` seconds pass); its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.status) not in runlog.ENDED:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the run in {self.dir} is still {status} after {timeout} s.")
            time.sleep(POLL)
        return status

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end; the `Result` (as `launch` returns it), or raise its `WorkerError`."""
        status = self.wait(timeout)
        if status == "finished":
            return dill.loads((self.dir / runlog.RESULT).read_bytes())
        if status == "cancelled":
            raise RuntimeError(f"the run in {self.dir} was cancelled; it has no result.")
        error = self.dir / runlog.ERROR
        if error.is_file():
            raise dill.loads(error.read_bytes())
        raise RuntimeError(self.reason)

    def cancel(self) -> None:
        """Stop the run: its ranks are stopped as a Ctrl-C stops a launch, and nothing of its
        processes is left. A run that has ended stays as it is."""
        supervisor = self.dir / runlog.SUPERVISOR
        if self.status in runlog.ENDED or not supervisor.is_file():
            return
        who = runlog.read_json(supervisor)
        if "slurm_job" in who:
            session.stop_slurm_job(who["slurm_job"])
        elif session.alive(who):
            session.stop(who["pid"])
        if runlog.read_json(self.dir / runlog.STATUS)["status"] not in runlog.ENDED:  # it died before saying so
            status = runlog.read_json(self.dir / runlog.STATUS)
            status.update(status="cancelled", reason="cancelled by Run.cancel()", ended=time.time())
            runlog.write_json(self.dir / runlog.STATUS, status)

    def logs(self, rank: int = 0) -> str:
        """What `rank` printed, every attempt's, as text."""
        lines = [e[4] for e in runlog.Tail(self.dir / runlog.rank_events(rank)).read() if e[1] == "output"]
        return "".join(line + "\n" for line in lines)

    def export(self, path) -> Path:
        """This run's job as a directory that runs with no notebook (see `nbtrain.export`)."""
        if not (self.dir / runlog.JOB).is_file():
            raise ValueError(f"{self.dir} was run by an exported job's run.sh, which keeps no job of its own: "
                             f"the exported directory ({self.dir.parent}) is the job; copy it instead.")
        fn, args, kwargs = load_job((self.dir / runlog.JOB).read_bytes())
        options = self.spec["launch"]
        return export(fn, *args, to=path, devices=options["devices"], accelerator=options["accelerator"],
                      num_nodes=options["num_nodes"], **kwargs)

    # -- the live view -------------------------------------------------------------------
    def watch(self, progress=None, output: bool = True) -> str:
        """Show the run as `launch` does, until it ends (Ctrl-C stops watching, not the run);
        `progress` as for `launch` (default: the Run's own, given to submit or attach)."""
        follower = Follower(self.dir, make_display(self.progress if progress is None else progress), output)
        try:
            while not follower.poll(self._status()):
                time.sleep(POLL)
        except KeyboardInterrupt:
            follower.display.note(f"stopped watching; the run goes on ({self.dir})")
        return self.status

    def _ipython_display_(self) -> None:
        display = make_display(self.progress)
        if not in_jupyter() or not isinstance(display, WidgetDisplay):  # lines would print into later cells
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
            while not follower.poll(self._status()):
                time.sleep(POLL)

        self._watcher = threading.Thread(target=follow, name="nbtrain-run-view", daemon=True)
        self._watcher.start()

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r}, function={self.function!r}, status={self.status!r})"


def attach(run_dir, progress=True) -> Run:
    """The run in `run_dir`, from any kernel: its status, live view, result, logs and cancel;
    `progress` is how it draws itself (as `launch(progress=...)`)."""
    check_progress(progress)
    return Run(run_dir, progress)


class Follower:
    """Reads a run's event logs as they grow, into a RunState that a display draws."""

    def __init__(self, run_dir: Path, display, output: bool):
        self.dir, self.display, self.output = run_dir, display, output
        self.run_events = runlog.Tail(run_dir / runlog.EVENTS)
        self.tails: dict[int, runlog.Tail] = {}
        self.state: RunState | None = None
        self.attempt = -1
        self.t0 = 0.0  # the attempt's start, wall clock
        self.done = False
        self.restart = ""  # the latest "restarting (k of N): why"

    def poll(self, status: dict) -> bool:
        """Take in what was written since the last poll; True once the run has ended and is drawn."""
        if self.done:
            return True
        ended = status["status"] in runlog.ENDED  # read first: every event before the end is in the files now
        for event in self.run_events.read():
            self._run_event(*event)
        if self.state is not None:
            for rank, tail in self.tails.items():
                for attempt, kind, _, *payload in tail.read():
                    if attempt == self.attempt:
                        self._rank_event(kind, rank, payload)
            self.display.update(self.state)
        if ended:
            if self.state is not None:
                self.state.ended = self.state.ended or time.monotonic()
                self.display.finish(self.state, status["status"] == "finished")
            elif status.get("reason"):
                self.display.note(status["reason"])
            self.done = True
        return self.done

    def _run_event(self, attempt: int, kind: str, _, *payload) -> None:
        if kind == "start":
            title, ranks, self.t0 = payload
            self.attempt = attempt
            if self.state is None:
                self.state = RunState(title, ranks)
                self.display.start(self.state)
            else:  # a restart: the same state object, begun again, so the display keeps drawing it
                self.state.__init__(title if self.output else f"{title} · {self.restart.replace('ing', 'ed', 1)}",
                                    ranks)
            self.state.started = time.monotonic() - (time.time() - self.t0)
            for rank in ranks:
                self.tails.setdefault(rank, runlog.Tail(self.dir / runlog.rank_events(rank)))
        elif kind == "note" and self.output:
            self.display.note(payload[0])
        elif kind == "note" and payload[0].startswith("restarting") and self.state is not None:
            # Drawn by a thread, a note would print into whichever cell runs: the title says it.
            self.restart = payload[0]
            self.state.title = f"{self.state.title.split(' · ')[0]} · {self.restart}"
            self.state.version += 1
        elif kind == "end" and attempt == self.attempt and self.state is not None:
            self.state.ended = self.state.started + (payload[1] - self.t0)

    def _rank_event(self, kind: str, rank: int, payload: list) -> None:
        state = self.state
        if kind == "output":
            if self.output:
                self.display.output(rank, *payload)
        elif kind == "finished":
            state.handle(("value", rank, None))
            state.ranks[rank].ended_where = payload[0]
        elif kind == "failed":
            state.fail(rank, *payload)
        elif kind == "stopped":
            state.stop(rank, *payload)
        elif kind == "vital":
            state.vitals.append(Vital(payload[0], rank, *payload[1:]))
            state.version += 1
        else:
            state.handle((kind, rank, *payload))


class RunTable(list):
    """`runs()`: one dict per run; shown as a table."""

    COLUMNS = ("run", "function", "started", "devices", "status", "metrics")

    def __repr__(self) -> str:
        rows = [self.COLUMNS, *([str(r[c]) for c in self.COLUMNS] for r in self)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.COLUMNS))]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(r[c]))}</td>"
                                        for c in self.COLUMNS) + "</tr>" for r in self)
        return f"<table><tr>{head}</tr>{body}</table>"


def runs(path="nbtrain-runs") -> RunTable:
    """The runs under `path`, oldest first: function, started, devices, status, last metrics."""
    base = Path(path)
    table = RunTable()
    if not base.is_dir():
        return table
    for entry in sorted(base.iterdir()):
        try:
            run = Run(entry)
        except ValueError:  # not a run (yet): a directory submit is still filling, or anything else
            continue
        options = run.spec["launch"]
        starts = [e for e in runlog.Tail(entry / runlog.EVENTS).read() if e[1] == "start"]
        # As the run planned them ("2 CPU ranks, gloo"); before it started, as they were asked for.
        devices = starts[-1][3].split(" on ", 1)[-1] if starts else f"{options['devices']} ({options['accelerator']})"
        metrics = {}
        for event in runlog.Tail(entry / runlog.rank_events(0)).read():
            if event[1] == "metric":
                metrics[event[4]] = event[5]
        table.append({"run": entry.name, "function": run.function,
                      "started": datetime.fromtimestamp(run.spec["started"]).strftime("%Y-%m-%d %H:%M:%S"),
                      "devices": devices, "status": run.status,
                      "metrics": ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
                      "dir": str(entry.absolute())})
    return table
