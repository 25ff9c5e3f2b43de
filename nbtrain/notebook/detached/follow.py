"""A submitted run's live view: its event logs read as they grow, into the `RunState` a display draws
(the same view `launch` draws)."""
from __future__ import annotations

import time
from pathlib import Path

from ...common import protocol, runlog
from ..run.runmodel import RunState


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
        self.stopped = ""  # why the run's event logs stopped, once said

    def poll(self, status: dict) -> bool:
        """Take in what was written since the last poll; True once the run has ended and is drawn."""
        if self.done:
            return True
        ended = status["status"] in runlog.ENDED  # read first: every event before the end is in the files now
        if status.get("events_stopped") and not self.stopped:
            self.stopped = status["events_stopped"]
            self.display.note(f"the run's event logging stopped ({self.stopped}): the run goes on, this view no "
                              "longer follows it; its status and result still come")
        for attempt, event in self.run_events.read():
            self._run_event(attempt, event)
        if self.state is not None:
            for tail in self.tails.values():
                for attempt, event in tail.read():
                    if attempt == self.attempt:
                        self._rank_event(event)
            self.display.update(self.state)
        if ended:
            if self.state is not None:
                self.state.ended = self.state.ended or time.monotonic()
                self.display.finish(self.state, status["status"] == "finished")
            elif status.get("reason"):
                self.display.note(status["reason"])
            self.done = True
        return self.done

    def _run_event(self, attempt: int, event) -> None:
        if isinstance(event, protocol.AttemptStarted):
            title, ranks, self.t0 = event.title, event.ranks, event.time
            self.attempt = attempt
            if self.state is None:
                self.state = RunState(title, ranks)
                self.display.start(self.state)
            else:  # a restart: the same state object, begun again, so the display keeps drawing it
                self.state.reset(title if self.output else f"{title} · {self.restart.replace('ing', 'ed', 1)}", ranks)
            self.state.started = time.monotonic() - (time.time() - self.t0)
            for rank in ranks:
                self.tails.setdefault(rank, runlog.Tail(self.dir / runlog.rank_events(rank)))
        elif isinstance(event, protocol.Note) and self.output:
            self.display.note(event.text)
        elif isinstance(event, protocol.Note) and event.text.startswith("restarting") and self.state is not None:
            # Drawn by a thread, a note would print into whichever cell runs: the title says it.
            self.restart = event.text
            self.state.title = f"{self.state.title.split(' · ')[0]} · {self.restart}"
            self.state.version += 1
        elif isinstance(event, protocol.Change) and attempt == self.attempt and self.state is not None:
            self.state.add_change(event)
        elif isinstance(event, protocol.AttemptEnded) and attempt == self.attempt and self.state is not None:
            self.state.ended = self.state.started + (event.time - self.t0)

    def _rank_event(self, event) -> None:
        if isinstance(event, protocol.Output):
            if self.output:
                self.display.output(event.rank, event.stream, event.text)
        else:  # what the ranks reported, and what the supervisor made of it: the state takes it as it did then
            assert self.state is not None, "the run's first event, its start, made the state"
            self.state.handle(event)
