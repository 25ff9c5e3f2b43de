"""A display that draws nothing and writes what it is given to a run directory's event logs.

A submitted run's supervisor runs `launch` with this as its display: what the ranks report
(progress, metrics, output, failures, vitals) goes to one file per rank, the run's notes to the
run's own file, and a notebook that attaches later feeds them to a `RunState` of its own
(`notebook/runs.py`). It has no `live` or `rich`: a redrawn bar arrives as its last lines.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..common import runlog
from .runstate import RunState
from .vitals import VitalsSampler

# RunState messages kept as they are; "result" carries the pickled value, which goes to
# result.pkl whole, so only that the rank finished (and where) is logged.
PLAIN = ("hello", "progress", "metric", "batch_size")


class RunRecorder:
    def __init__(self, run_dir: Path, attempt: int):
        self.dir, self.attempt = Path(run_dir), attempt
        self.run_events = runlog.EventLog(self.dir / runlog.EVENTS)
        self.logs: dict[int, runlog.EventLog] = {}
        self.vitals = VitalsSampler()
        self._vitals_written = 0

    def _log(self, rank) -> runlog.EventLog:
        if rank is None:
            return self.run_events
        if rank not in self.logs:
            self.logs[rank] = runlog.EventLog(self.dir / runlog.rank_events(rank))
        return self.logs[rank]

    def _write(self, rank, kind: str, *payload) -> None:
        self._log(rank).write(self.attempt, kind, rank, *payload)

    def start(self, state: RunState) -> None:
        self._write(None, "start", state.title, sorted(state.ranks), time.time())
        handle, fail, stop = state.handle, state.fail, state.stop

        # The state's own methods, recorded as they are called: every change the pool makes.
        def handled(message: tuple) -> None:
            kind, rank, *payload = message
            if kind in PLAIN:
                self._write(rank, kind, *payload)
            elif kind == "result":
                self._write(rank, "finished", payload[1] if len(payload) > 1 else "")
            handle(message)

        def failed(rank: int, summary: str, traceback: str = "", crashed: bool = False, **more) -> None:
            self._write(rank, "failed", summary, traceback, crashed)
            fail(rank, summary, traceback, crashed, **more)

        def stopped(rank: int, why: str = "", stack: str = "") -> None:
            self._write(rank, "stopped", why, stack)
            stop(rank, why, stack)

        state.handle, state.fail, state.stop = handled, failed, stopped

    def note(self, text: str) -> None:
        self._write(None, "note", text)

    def output(self, rank, stream: str, text: str) -> None:
        self._write(rank, "output", stream, text)

    def update(self, state: RunState) -> None:
        self.vitals.maybe_sample(state)
        for vital in state.vitals[self._vitals_written:]:
            self._write(vital.rank, "vital", *vital[:1], *vital[2:])
        self._vitals_written = len(state.vitals)

    def finish(self, state: RunState, ok: bool) -> None:
        self.update(state)
        self._write(None, "end", ok, time.time())

    def close(self) -> None:
        for log in (self.run_events, *self.logs.values()):
            log.close()
