"""The model of a run: what the notebook knows of it, and what it makes of it.

Each rank's status, progress bars, metrics, vitals and returned value; who failed first, and who
only lost a peer (the blame); how each rank reads once the run has ended. The ranks' messages
(`common/protocol.py`) and the supervisor's verdicts update it; displays (`display/`) read it at
their own pace and decide nothing, so the rate at which ranks report never sets the rate at which
anything is drawn. Observers (`subscribe`) hear every change as a run event: a submitted run's
recorder writes them to its logs, and a notebook that attaches feeds them back to a RunState.
"""
from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...common import protocol
from ...common.protocol import Metric, Vital
from ...common.words import ranks_words
from . import doctor

RECENT = 10.0  # seconds of (time, steps) kept per rank for its recent step rate
STALLED = 1.0  # seconds a rank may be silent before the notebook's clock counts against its rate

_MISSING_CLASS = re.compile(r"Can't get attribute '([\w.]+)' on <module '__main__'")


@dataclass
class Bar:
    """One progress level of a rank; `started` and `updated` are by the rank's clock. A loop
    resumed at `initial` reads initial..total; its rate counts only the steps after `initial`."""
    desc: str
    n: int = 0
    total: int | None = None
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    updated: float = field(default_factory=time.monotonic)
    initial: int = 0

    @property
    def rate(self) -> float | None:
        elapsed, steps = self.updated - self.started, self.n - self.initial
        return steps / elapsed if elapsed > 0 and steps > 0 else None

    @property
    def eta(self) -> float | None:
        rate = self.rate
        if rate is None or self.total is None or self.done:
            return None
        return max(0.0, (self.total - self.n) / rate)


# An error that only says a peer went away (gloo, NCCL, the TCP store): a consequence of
# another rank's failure, never its cause while that other failure is known.
LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|DistBackendError|ProcessGroupGloo|"
                       r"gloo/transport|NCCL (communicator|error).*(abort|remote)|remote process exited|"
                       r"RendezvousClosed|TCPStore|recvValue|Socket Timeout", re.IGNORECASE)


def brief(text: str) -> str:
    """A lost peer's error in a few words: gloo's source location and its advice trimmed off."""
    line = text.splitlines()[0] if text else ""
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return re.split(r"\.\s+This is typically caused", line)[0]


@dataclass
class RankView:
    rank: int
    status: str = "starting"  # starting, running, finished, failed, stopped (because another rank failed)
    detail: str = ""  # first line of the failure; for a stopped rank "stopped (rank 1 failed)"
    reason: str = ""  # a stopped rank's own first line (what it said as it was stopped), may be ""
    pid: int | None = None
    host: str | None = None  # the machine it runs on, as it names itself
    ended_at: float | None = None  # when it finished or failed
    ended_where: str = ""  # how a finished rank ended: "returned from train()", "called sys.exit(0) at ..."
    bars: dict[int, Bar] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)
    # Iterations of the innermost progress level, across its restarts (epochs), and when they
    # happened by the rank's own clock: the rank's step rate. Counted from the first event that
    # reports a finished step, so time spent before it (waiting at the first collective for a
    # rank still setting up) is not read as slowness.
    steps: int = 0
    step_level: int = -1
    first_step: tuple[float, int] | None = None  # (rank clock, steps) when steps were first seen
    last_step: float | None = None
    recent: deque = field(default_factory=deque)  # (rank clock, steps) over the last RECENT seconds
    # The smallest (notebook clock - rank clock) seen on arrival: maps the notebook's "now" onto
    # the rank's clock, so a rank that stops reporting is seen to slow down.
    lag: float | None = None

    def count_steps(self, level: int, n: int, previous: int, at: float, arrived: float) -> None:
        self.lag = arrived - at if self.lag is None else min(self.lag, arrived - at)
        if level < self.step_level:
            return
        if level > self.step_level:  # a deeper loop: its iterations are the steps
            self.step_level, self.steps, self.first_step = level, 0, None
            self.recent.clear()
        self.steps += max(0, n - previous)
        if not self.steps:
            return
        self.first_step = self.first_step or (at, self.steps)
        self.last_step = at
        self.recent.append((at, self.steps))
        while len(self.recent) > 2 and at - self.recent[1][0] >= RECENT:
            self.recent.popleft()

    @property
    def step_rate(self) -> float | None:
        """Steps per second over the whole run so far, by the rank's clock; None before half a
        second of steps (events are sent every 0.1 s: a shorter span would not measure anything)."""
        if self.first_step is None or self.last_step is None:  # set together, by the first step
            return None
        at, steps = self.first_step
        span = self.last_step - at
        return (self.steps - steps) / span if span >= 0.5 else None

    def recent_rate(self, window: float, now: float) -> float | None:
        """Steps per second over the rank's last `window` seconds, by its clock. `now` (the
        notebook's clock) counts only once the rank has been silent for STALLED seconds: until
        then the latest event is the rank's now, so batching of events adds no noise."""
        if not self.recent or self.lag is None:
            return None
        end, steps = self.recent[-1]
        silent = now - self.lag - end
        if silent > STALLED:
            end += silent
        start = next(((t, s) for t, s in reversed(self.recent) if end - t >= window), self.recent[0])
        span = end - start[0]
        return (steps - start[1]) / span if span >= 0.5 else None


@dataclass
class Failure:
    rank: int
    summary: str
    traceback: str = ""
    crashed: bool = False  # died by a signal or exit code (or ended early), not by a Python exception
    lost_peer: bool = False  # its error only says another rank went away
    exception: bytes | None = None  # the original exception, pickled in the rank (see transfer.pack_exception)


class RunState:
    def __init__(self, title: str, ranks: list[int]):
        self._observers: list[Callable] = []
        self.reset(title, ranks)

    def reset(self, title: str, ranks: list[int]) -> None:
        """Begin again (a restarted run's next attempt), keeping the observers."""
        self.title = title
        self.started = time.monotonic()
        self.ranks = {r: RankView(r) for r in ranks}
        self.history: list[Metric] = []
        self.values: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.vitals: list[Vital] = []  # sampled for the displays (display/vitals.py), kept in Result.vitals
        self.profiles: dict[int, dict] = {}  # each profiled rank's summary (rank/profiling.py)
        self.step_times: dict[int, protocol.StepTimes] = {}  # each rank's time split, sent with its reply
        self.stall: str | None = None  # the doctor's verdict while no rank progresses (`doctor.py`), until one does
        self.effective_batch_size: int | None = None
        self.per_rank_batch_size: int | None = None
        self.version = 0  # bumped on every change, so a display redraws only when needed
        self.ended: float | None = None
        self.interrupted: set[int] = set()  # ranks interrupted by nbtrain (live ranks), not by their own fault
        self.queued: str | None = None  # while an engine holds the ranks in its queue: where and why
        self.changes: list[protocol.Change] = []  # a steered run's (`steer.py`), each with its step

    # -- observers -----------------------------------------------------------------------
    def subscribe(self, observer: Callable) -> None:
        """Call `observer(event)` with each run event (`protocol`: Hello, Progress, Metric, BatchSize,
        Profile, Finished, Failed, Stopped, Vital) once the state has taken it in."""
        self._observers.append(observer)

    def _changed(self, event=None) -> None:
        self.version += 1
        if event is not None:
            for observer in self._observers:
                observer(event)

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    # -- what the ranks report -----------------------------------------------------------
    def handle(self, message) -> None:
        """A `protocol` record from a rank, or a run event read back from a log."""
        view = self.ranks.get(message.rank)
        handler = getattr(self, f"_on_{message.kind}", None)
        if view is None or handler is None:
            return
        if handler(view, message) is not False:  # False: it turned into another event, told already
            self._changed(message)

    def _on_hello(self, view: RankView, hello: protocol.Hello) -> None:
        view.pid, view.host = hello.pid, hello.host or view.host
        view.status = "running"

    def _on_progress(self, view: RankView, event: protocol.Progress) -> None:
        # `initial` (where the loop began) came later: events logged before it began at 0.
        arrived = time.monotonic()
        at = arrived if event.at is None else event.at  # the rank's own clock (an in-process run shares the kernel's)
        bar = view.bars.get(event.level)
        if bar is None or event.begins or bar.desc != event.desc:
            bar = view.bars[event.level] = Bar(event.desc, n=event.initial, total=event.total, started=at, updated=at,
                                               initial=event.initial)
            for deeper in [lv for lv in view.bars if lv > event.level]:
                del view.bars[deeper]
        view.count_steps(event.level, event.n, bar.n, at, arrived)
        self.stall = None  # progress again: the doctor's stall verdict no longer holds
        bar.n, bar.total, bar.done, bar.updated = event.n, event.total, event.done, at

    def _on_metric(self, view: RankView, metric: Metric) -> None:
        view.metrics[metric.name] = metric
        self.history.append(metric)

    def _on_profile(self, view: RankView, profile: protocol.Profile) -> None:
        self.profiles[view.rank] = profile.summary

    def _on_step_times(self, view: RankView, times: protocol.StepTimes) -> bool:
        self.step_times[view.rank] = times
        self._changed()
        return False  # the model's own: not a run event

    def _on_batch_size(self, view: RankView, event: protocol.BatchSize) -> None:
        if self.effective_batch_size is None:
            self.per_rank_batch_size, self.effective_batch_size = event.per_rank, event.effective

    def _on_result(self, view: RankView, returned: protocol.Returned) -> bool:
        from ...common.transfer import unpack_result  # torch: `nbtrain runs` reads run models without it

        try:
            value = unpack_result(returned.payload)
        except AttributeError as exc:  # a class only the rank has: "Can't get attribute 'MLP' on <module '__main__'>"
            missing = _MISSING_CLASS.search(str(exc))
            if missing is None:
                raise
            self.fail(view.rank, f"rank {view.rank} returned an object of class {missing[1]!r}, which was defined on "
                      "the ranks only (a %%ranks cell or ranks.exec): the notebook cannot rebuild it. Define "
                      "the class in the notebook too (run its code in a notebook cell), or return plain data "
                      "(a state_dict, tensors, numbers).")
            return False
        self.finish(view.rank, value, returned.where)
        return False

    def _on_finished(self, view: RankView, finished: protocol.Finished) -> bool:
        self.finish(view.rank, None, finished.where)  # read back from a log: the value is in result.pkl
        return False

    def _on_error(self, view: RankView, raised: protocol.Raised) -> bool:
        self.fail(view.rank, raised.summary, raised.traceback, exception=raised.exception)
        return False

    def _on_failed(self, view: RankView, failed: protocol.Failed) -> bool:
        self.fail(view.rank, failed.summary, failed.traceback, failed.crashed)
        return False

    def _on_stopped(self, view: RankView, stopped: protocol.Stopped) -> bool:
        self.stop(view.rank, stopped.why, stopped.stack)
        return False

    def _on_vital(self, view: RankView, vital: Vital) -> None:
        self.vitals.append(vital)

    # -- what the notebook finds ---------------------------------------------------------
    def finish(self, rank: int, value, where: str = "") -> None:
        """`rank` returned `value` (unpacked already: an in-process run hands it over directly)."""
        view = self.ranks[rank]
        self.values[rank] = value
        view.status, view.ended_at, view.ended_where = "finished", time.monotonic(), where
        self._changed(protocol.Finished(rank, where))

    def add_vital(self, vital: Vital) -> None:
        """A rank's vital signs, sampled by a display (`display/vitals.py`)."""
        self.handle(vital)

    def add_change(self, change: protocol.Change) -> None:
        """A steering change made on every rank (a run event: the recorder logs it)."""
        self.changes.append(change)
        self._changed(change)

    def set_stall(self, verdict: str) -> None:
        """The doctor found that no rank progresses: its verdict, in words."""
        self.stall = verdict
        self._changed()

    def set_queued(self, where: str | None) -> None:
        """Where an engine holds the ranks in its queue (a SLURM job's state); None once they run."""
        if where != self.queued:
            self.queued = where
            self._changed()

    def fail(self, rank: int, summary: str, traceback: str = "", crashed: bool = False, ended_early: bool = False,
             exception: bytes | None = None, even_if_stopped: bool = False) -> None:
        view = self.ranks[rank]
        if view.status == "failed" or (view.status == "stopped" and not even_if_stopped):
            return
        lost = not crashed and bool(LOST_PEER.search(summary or ""))
        view.status, view.detail = "failed", summary.splitlines()[0] if summary else ""
        view.ended_at = view.ended_at or time.monotonic()
        if ended_early:  # it had finished; it is now the cause of the others' wait
            self.values.pop(rank, None)
        self.failures.append(Failure(rank, summary, traceback, crashed, lost, exception))
        self._blame()
        self._changed(protocol.Failed(rank, summary, traceback, crashed))

    def stop(self, rank: int, why: str = "", stack: str = "") -> None:
        """`rank` was stopped (or interrupted) because of another rank's failure or a time-out."""
        view = self.ranks[rank]
        if view.status in ("failed", "stopped"):
            return
        view.status, view.reason = "stopped", why.splitlines()[0] if why else ""
        view.ended_at = time.monotonic()
        if stack:
            view.reason += f"\n{stack}"
        self._blame()
        self._changed(protocol.Stopped(rank, why, stack))

    def _blame(self) -> None:
        """Ranks whose only fault is a lost peer, or that were stopped, read as stopped by the cause."""
        if not self.failures:
            for view in self.ranks.values():
                if view.status == "stopped":
                    view.detail = "stopped"
            return
        cause = self.root_cause()
        for failure in self.failures:
            view = self.ranks[failure.rank]
            if failure is not cause and failure.lost_peer and view.status == "failed":
                view.status, view.reason = "stopped", brief(view.detail)
        for view in self.ranks.values():
            if view.status == "stopped":
                view.detail = f"stopped (rank {cause.rank} failed)"

    def unfinished(self) -> list[int]:
        return [r for r, v in self.ranks.items() if v.status in ("starting", "running")]

    def ended_ranks(self) -> list[int]:
        return [r for r, v in self.ranks.items() if v.status == "finished"]

    def only_lost_peers(self) -> bool:
        return bool(self.failures) and all(f.lost_peer for f in self.failures)

    def root_cause(self) -> Failure:
        # A crash (or a rank that ended early) explains the peers' "connection closed" errors that
        # may have arrived first; then a rank's own exception; a lost peer only when nothing else is known.
        for kind in (lambda f: f.crashed, lambda f: not f.lost_peer, lambda f: True):
            found = [f for f in self.failures if kind(f)]
            if found:
                return found[0]
        raise LookupError("no failure")

    def outcome_lines(self, cause: Failure) -> list[str]:
        """Every other rank's outcome in rank order, ranks whose outcomes read the same said together
        ("ranks 0, 2-7: stopped after rank 1 failed (waiting for rank 1 in all_reduce #2 ...)")."""
        said: dict[str, list[int]] = {}
        for rank, view in sorted(self.ranks.items()):
            if rank != cause.rank:
                said.setdefault(self._outcome_words(view, cause), []).append(rank)
        return [f"{ranks_words(ranks)}: {words}" for words, ranks in said.items()]

    @staticmethod
    def _outcome_words(view: RankView, cause: Failure) -> str:
        if view.status == "stopped":
            own = view.reason.splitlines()[0] if view.reason else ""
            if own.startswith("stopped"):  # the launcher already said who stopped it, and why
                return own
            return f"stopped after rank {cause.rank} failed" + (f" ({own})" if own else "")
        if view.status == "failed":
            return f"failed: {view.detail}"
        if view.status == "finished":
            return "finished" + (f" ({view.ended_where})" if view.ended_where else "")
        return view.status

    # -- how the run reads once it ended -------------------------------------------------
    @property
    def straggler(self) -> str | None:
        """'rank 1 is 1.9x slower than the others: 70 % of its step waiting for data', or None (a failed run: None)."""
        return doctor.straggler(self.step_times) if not self.failures else None

    def doctor_lines(self) -> list[str]:
        """What the doctor says under a run's summary: a straggler, each rank's time split."""
        straggler = self.straggler if not self.failures else None  # a failed run's times say little
        if not straggler:
            return []
        splits = "; ".join(f"rank {r}: {doctor.split_words(t)}" for r, t in sorted(self.step_times.items()))
        return [f"{straggler} ({splits})"]

    def verdict(self, ok: bool) -> str:
        """How the run ended: finished, failed (a rank failed or timed out) or interrupted (Ctrl-C)."""
        return "finished" if ok else ("failed" if self.failures else "interrupted")

    def outcome(self, rank: int, final: bool) -> tuple[str, str, str]:
        """(status, detail, reason) of `rank` as a reader should see them.

        A rank still running when the run ended (`final`) was stopped by nbtrain: it reads
        "stopped (rank N failed)" (or "interrupted"), never "failed". `reason` is a stopped rank's
        own message (often a peer's disconnect), shown folded.
        """
        view = self.ranks[rank]
        status, detail, reason = view.status, view.detail, view.reason
        if final and status in ("starting", "running"):
            status = "stopped"
        if status == "stopped" and not detail:
            detail = f"stopped (rank {self.root_cause().rank} failed)" if self.failures else "stopped (interrupted)"
        return status, detail, reason
