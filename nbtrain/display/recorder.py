"""A display that draws nothing and writes what it is given to a run directory's event logs.

A submitted run's supervisor runs `launch` with this as its display. It subscribes to the run's
model (`notebook/runmodel.RunState`): every run event (progress, metrics, failures, vitals) goes
to one file per rank, with the ranks' output; the run's notes to the run's own file. A notebook
that attaches later feeds them to a `RunState` of its own (`notebook/detached/runs.py`). It has no `live`
or `rich`: a redrawn bar arrives as its last lines.

The logs are best effort: a write that fails (a full disk) stops them, says so once (`stopped`,
which the supervisor puts in status.json) and never reaches the training. It also keeps
summary.json, what `runs()` lists (devices, ranks, rank 0's last metrics), written at the start
and end of each attempt and at most every SUMMARY_INTERVAL seconds between: a listing reads it
instead of the logs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..common import protocol, runlog
from .vitals import VitalsSampler

# Logged as they come; a bar's progress is thinned (PROGRESS_INTERVAL), a profile not logged.
PLAIN = (protocol.Hello, protocol.Metric, protocol.BatchSize, protocol.Failed, protocol.Finished,
         protocol.Stopped, protocol.Vital)
PROGRESS_INTERVAL = 1.0  # seconds between the logged updates of one bar
SUMMARY_INTERVAL = 5.0  # seconds between the rewrites of summary.json while the run goes on


class RunRecorder:
    def __init__(self, run_dir: Path, attempt: int, queued=None, echo=None, summary: dict | None = None,
                 stopped=None):
        self.dir, self.attempt = Path(run_dir), attempt
        self.echo = echo  # a display that draws the run too (an exported job's terminal), or None
        # summary.json's content, kept by the supervisor across attempts (rank 0's metrics of
        # earlier attempts stay until this one logs its own).
        self.summary: dict[str, Any] = {"devices": "", "ranks": [], "metrics": {}} if summary is None else summary
        self._summarised = float("-inf")
        # Called once with the reason, when the logs stop (a full disk); None: stop silently.
        self.on_stop, self.stopped = stopped, ""
        # Called with the state's `queued` (where a cluster holds the ranks; None once they run)
        # each time it changes: the supervisor's status says "queued" until then.
        self.queued, self._queued_seen = queued, ...
        self.logs: dict[int | None, runlog.EventLog] = {}  # rank -> its log; None -> the run's own
        self.vitals = VitalsSampler()
        # A bar's updates, at most one a second each: a ranks' bar reports up to ten a second, and a
        # run of hours would otherwise log millions of them. Each carries the bar's whole position,
        # so the one held back is written before anything else of its rank, and at the end.
        self._held: dict[tuple[int, int], protocol.Progress] = {}  # (rank, level): the latest unwritten update
        self._written: dict[tuple[int, int], float] = {}  # (rank, level): when one was last written

    def _log(self, rank) -> runlog.EventLog:
        if rank not in self.logs:
            self.logs[rank] = runlog.EventLog(self.dir / (runlog.EVENTS if rank is None else runlog.rank_events(rank)))
        return self.logs[rank]

    def _write(self, rank, event) -> None:
        """`event` into `rank`'s log (None: the run's own)."""
        if self.stopped:
            return
        try:
            self._log(rank).write(self.attempt, event)
        except OSError as error:  # the run goes on without its logs: never the training's failure
            name = runlog.EVENTS if rank is None else runlog.rank_events(rank)
            self.stopped = str(error) if isinstance(error, runlog.IncompleteWrite) else \
                f"{name}: {(error.strerror or str(error)).lower()}"
            if self.on_stop is not None:
                self.on_stop(self.stopped)
            if self.echo is not None:
                self.echo.note(f"event logging stopped ({self.stopped}); the run goes on")

    def _summarise(self, due: float | None = None) -> None:
        """Rewrite summary.json (if `due` seconds have passed since the last time); best effort,
        as the logs: a listing falls back on the logs."""
        now = time.monotonic()
        if due is not None and now - self._summarised < due:
            return
        self._summarised = now
        try:
            runlog.write_json(self.dir / runlog.SUMMARY, self.summary)
        except OSError:
            pass

    def start(self, state) -> None:
        self._write(None, protocol.AttemptStarted(state.title, sorted(state.ranks), time.time()))
        self.summary.update(devices=state.title.split(" on ", 1)[-1], ranks=sorted(state.ranks))
        self._summarise()
        if self.echo is not None:
            self.echo.start(state)
        state.subscribe(self._record)

    def _record(self, event) -> None:
        """A run event (`protocol`) into its rank's log: every change the ranks and the supervisor make."""
        if isinstance(event, protocol.Progress):
            self._progress(event)
        elif isinstance(event, protocol.Change):  # the run's, not a rank's
            self._write(None, event)
        elif isinstance(event, PLAIN):
            if not isinstance(event, (protocol.Stopped, protocol.Vital)):  # the bars' positions before it
                self._flush(event.rank)
            self._write(event.rank, event)
            if isinstance(event, protocol.Metric) and event.rank == 0:
                value = event.value
                self.summary["metrics"][runlog.metric_name(event.name)] = \
                    value if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)

    def _progress(self, event: protocol.Progress) -> None:
        key, now = (event.rank, event.level), time.monotonic()
        if key in self._held and self._held[key].desc != event.desc:  # a new bar here: the old one's end first
            self._flush(event.rank)
        # A loop's first event is never held back, nor its last.
        if not event.begins and not event.done and now - self._written.get(key, float("-inf")) < PROGRESS_INTERVAL:
            self._held[key] = event
            return
        self._held.pop(key, None)  # this one says where the bar is now
        self._flush(event.rank)
        self._write(event.rank, event)
        self._written[key] = now

    def _flush(self, rank=None, due: float | None = None) -> None:
        """Write the held bar updates (of `rank`; of every rank; those older than `due` seconds)."""
        now = time.monotonic()
        for key in [k for k in self._held if rank is None or k[0] == rank]:
            if due is None or now - self._written.get(key, float("-inf")) >= due:
                self._write(key[0], self._held.pop(key))
                self._written[key] = now

    def note(self, text: str) -> None:
        self._write(None, protocol.Note(text))
        if self.echo is not None:
            self.echo.note(text)

    def output(self, rank, stream: str, text: str) -> None:
        self._write(rank, protocol.Output(rank, stream, text))
        if self.echo is not None:
            self.echo.output(rank, stream, text)

    def update(self, state) -> None:
        if self.queued is not None and state.queued != self._queued_seen:
            self._queued_seen = state.queued
            self.queued(state.queued)
        self._flush(due=PROGRESS_INTERVAL)
        self.vitals.maybe_sample(state)  # the samples come back as events
        self._summarise(due=SUMMARY_INTERVAL)
        if self.echo is not None:
            self.echo.update(state)

    def finish(self, state, ok: bool) -> None:
        self._flush()
        self.update(state)
        self._write(None, protocol.AttemptEnded(ok, time.time()))
        self._summarise()
        if self.echo is not None:
            self.echo.finish(state, ok)

    def close(self) -> None:
        self._summarise()
        for log in self.logs.values():
            log.close()
