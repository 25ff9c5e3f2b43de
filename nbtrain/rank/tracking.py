"""A rank's trackers at work: `ctx.log`'s values to each tracker's writer, on a thread of their own.

Values logged with `sync_dist=True` are the same on every rank: rank 0 alone writes them under
their name. Other values are each rank's own, written as `name/rank{N}` by that rank.

Every wait on a tracker is bounded, and a tracker that fails is named with where it writes: a
server that does not answer fails the run within a minute (MLflow: each request given 10 s and 2
retries; W&B: its init and finish timeouts), a full disk is said as such. Values are written on a
thread of their own, so a slow tracker slows no training step; what queued up meanwhile goes in
one batch.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import queue
import threading
from dataclasses import dataclass

from .tracker_writers import Writer
from .trackers import MLFLOW_HTTP, MLflow, TrackerError

BATCH = 10_000  # values taken off the queue at once: what queued up while the last batch was written
REFUSED, SILENT = "connection refused", "no answer in time"  # a server's two ways of not answering


@dataclass
class RunInfo:
    """What a rank's writers need to know of the run."""
    name: str
    dir: str
    rank: int
    world_size: int
    settings: dict


class Trackers:
    """This rank's writers, opened from the settings: rank 0's at the start (they carry the
    hyper-parameters), another rank's when it first logs a value of its own. Values are written
    on a thread of their own: building a tracker's records costs the training loop nothing but a
    queue put, and the writing overlaps the loop's torch operators (which release the GIL). A
    tracker that fails is written to no more; close() raises its error, naming it."""

    def __init__(self, settings: tuple, run: RunInfo):
        self.settings, self.run = settings, run
        self.writers: dict[str, Writer] = {}
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: TrackerError | None = None  # the first a writer raised: raised again by close()
        self.failed: str | None = None  # the name of the tracker that raised it
        self.thread = threading.Thread(target=self._write, name="nbtrain-trackers", daemon=True)
        self.added: list[str] = []  # what start() set in os.environ, for the run

    def start(self, share) -> None:
        """Open rank 0's writers; `share(value)` hands rank 0's value to every rank (a collective)."""
        for tracker in self.settings:
            # Before any thread of ours runs (os.environ is not safe to change beside one), for
            # the run only: close() restores it, as a run in the kernel's own process needs.
            for key, value in tracker.environment.items():
                if key not in os.environ:
                    self.added.append(key)
                    os.environ[key] = value
        for tracker in self.settings:
            # Imported now on every rank (about a second for some): not in the middle of training,
            # when a rank's first value of its own opens its writer.
            importlib.import_module(tracker.client)
        if self.run.rank == 0:
            for tracker in self.settings:
                self._writer(tracker)
        for tracker in self.settings:
            if tracker.shared:
                run_id = share(self.writers[tracker.name].run_id if self.run.rank == 0 else None)  # type: ignore[attr-defined]
                if self.run.rank != 0:
                    self._writer(tracker).join(run_id)  # type: ignore[attr-defined]  # shared: MLflow's writer
        self.thread.start()

    def _writer(self, tracker) -> Writer:
        writer = self.writers.get(tracker.name)
        if writer is None:
            with self._said(tracker, "could not start"):
                writer = self.writers[tracker.name] = tracker.opened(self.run)
        return writer

    @contextlib.contextmanager
    def _said(self, tracker, doing: str):
        """A tracker's error as one line: what failed, where it writes, and why."""
        try:
            yield
        except TrackerError:
            raise
        except Exception as exc:
            reason = _reason(exc)
            if isinstance(tracker, MLflow) and reason in (REFUSED, SILENT):
                setting = {k: os.environ.get(k, v) for k, v in MLFLOW_HTTP.items()}
                reason += (f" (each request given {setting['MLFLOW_HTTP_REQUEST_TIMEOUT']} s, "
                           f"{setting['MLFLOW_HTTP_REQUEST_MAX_RETRIES']} retries: MLFLOW_HTTP_REQUEST_TIMEOUT, "
                           "MLFLOW_HTTP_REQUEST_MAX_RETRIES)")
            raise TrackerError(f"{tracker.where(self.run)} {doing}: {reason}") from exc

    def log(self, name: str, value: float, step: int, synced: bool) -> None:
        if synced and self.run.rank != 0:
            return  # the same value on every rank: rank 0 writes it once
        self.queue.put((name if synced else f"{name}/rank{self.run.rank}", value, step))

    def _write(self) -> None:
        done = False
        while not done:
            items = [self.queue.get()]
            while len(items) < BATCH and items[-1] is not None:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            done = items[-1] is None  # close() puts None last
            values = items[:-1] if done else items
            if self.error is not None or not values:
                continue  # a writer failed: the rest is dropped, close() says why
            for tracker in self.settings:
                try:
                    with self._said(tracker, "could not write"):
                        writer = self._writer(tracker)
                        for item in values:
                            writer.log(*item)
                        writer.written()
                except TrackerError as exc:
                    self.error, self.failed = exc, tracker.name
                    break

    def close(self, failed: bool = False) -> None:
        try:
            if self.thread.is_alive():
                self.queue.put(None)
                self.thread.join()  # bounded: each tracker's calls are
            for tracker in self.settings:
                writer = self.writers.pop(tracker.name, None)
                if writer is None:
                    continue
                if tracker.name == self.failed:
                    writer.abandon()
                    continue
                try:
                    with self._said(tracker, "could not finish"):
                        writer.close(failed)
                except TrackerError as exc:
                    self.error = self.error or exc
        finally:
            for key in self.added:
                os.environ.pop(key, None)
            self.added.clear()
        if self.error is not None and not failed:
            raise self.error


def _reason(exc: BaseException) -> str:
    """Why, in a few words: the system's own (no space left on device) where it gave them; for a
    server, whether it refused or did not answer; else the error's type and first line."""
    if isinstance(exc, OSError) and exc.strerror:
        said = exc.strerror[:1].lower() + exc.strerror[1:]
        return f"{said} ({exc.filename})" if exc.filename else said
    text = (str(exc).strip().splitlines() or [""])[0]
    lowered = text.lower()
    if "connection refused" in lowered:
        return REFUSED
    if "timed out" in lowered or "deadline exceeded" in lowered:
        return SILENT
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
