"""What the notebook knows about a run: each rank's status, progress bars and metrics.

Messages from the ranks update this state; displays read it at their own pace, so the rate
at which ranks report never sets the rate at which anything is drawn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .transfer import unpack_result


class Metric(NamedTuple):
    step: int
    rank: int
    name: str
    value: float
    synced: bool


@dataclass
class Bar:
    desc: str
    n: int = 0
    total: int | None = None
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    updated: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float | None:
        elapsed = self.updated - self.started
        return self.n / elapsed if elapsed > 0 and self.n else None

    @property
    def eta(self) -> float | None:
        rate = self.rate
        if rate is None or self.total is None or self.done:
            return None
        return max(0.0, (self.total - self.n) / rate)


@dataclass
class RankView:
    rank: int
    status: str = "starting"  # starting, running, finished, failed
    detail: str = ""  # first line of the failure
    pid: int | None = None
    bars: dict[int, Bar] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)


@dataclass
class Failure:
    rank: int
    summary: str
    traceback: str = ""
    crashed: bool = False  # died by a signal or exit code, not by a Python exception
    original: bytes | None = None  # the exception itself, packed by the rank (transfer.pack_exception)


class RunState:
    def __init__(self, title: str, ranks: list[int]):
        self.title = title
        self.started = time.monotonic()
        self.ranks = {r: RankView(r) for r in ranks}
        self.history: list[Metric] = []
        self.values: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.effective_batch_size: int | None = None
        self.per_rank_batch_size: int | None = None
        self.version = 0  # bumped on every change, so a display redraws only when needed
        self.ended: float | None = None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def handle(self, message: tuple) -> None:
        kind, rank, *payload = message
        view = self.ranks.get(rank)
        if view is None:
            return
        self.version += 1
        getattr(self, f"_on_{kind}", self._on_unknown)(view, *payload)

    def _on_unknown(self, view, *payload) -> None:
        pass

    def _on_hello(self, view: RankView, pid: int) -> None:
        view.pid = pid
        view.status = "running"

    def _on_progress(self, view: RankView, level: int, desc: str, n: int, total, done: bool) -> None:
        bar = view.bars.get(level)
        if bar is None or (n == 0 and not done) or bar.desc != desc:
            bar = view.bars[level] = Bar(desc, total=total)
            for deeper in [lv for lv in view.bars if lv > level]:
                del view.bars[deeper]
        bar.n, bar.total, bar.done, bar.updated = n, total, done, time.monotonic()

    def _on_metric(self, view: RankView, step: int, name: str, value: float, synced: bool) -> None:
        metric = Metric(step, view.rank, name, value, synced)
        view.metrics[name] = metric
        self.history.append(metric)

    def _on_batch_size(self, view: RankView, per_rank: int, effective: int) -> None:
        if self.effective_batch_size is None:
            self.per_rank_batch_size, self.effective_batch_size = per_rank, effective

    def _on_result(self, view: RankView, payload: bytes) -> None:
        self.values[view.rank] = unpack_result(payload)
        view.status = "finished"

    def _on_value(self, view: RankView, value) -> None:
        # In-process runs hand the value over directly: nothing to unpack.
        self.values[view.rank] = value
        view.status = "finished"

    def _on_error(self, view: RankView, summary: str, traceback: str, original: bytes | None = None) -> None:
        self.fail(view.rank, summary, traceback, original=original)

    def fail(self, rank: int, summary: str, traceback: str = "", crashed: bool = False,
             original: bytes | None = None) -> None:
        view = self.ranks[rank]
        if view.status == "failed":
            return
        view.status, view.detail = "failed", summary.splitlines()[0] if summary else ""
        self.failures.append(Failure(rank, summary, traceback, crashed, original))
        self.version += 1

    def unfinished(self) -> list[int]:
        return [r for r, v in self.ranks.items() if v.status in ("starting", "running")]

    def root_cause(self) -> Failure:
        # A rank that crashed explains the peers' "connection closed" errors that may have
        # arrived first; otherwise the earliest failure is the cause.
        crashed = [f for f in self.failures if f.crashed]
        return crashed[0] if crashed else self.failures[0]

    def latest_metrics(self) -> dict[str, Metric]:
        latest: dict[str, Metric] = {}
        for view in self.ranks.values():
            for name, metric in view.metrics.items():
                if name not in latest or metric.rank == 0:
                    latest[name] = metric
        return latest
