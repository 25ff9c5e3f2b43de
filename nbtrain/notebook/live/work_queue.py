"""A map's work queue: items handed to workers as they ask, results kept in order and saved.

`WorkQueue` is the notebook's side of the map's own channel (a `Hub`; the workers are
`rank/work.py`): a worker asks for items when it is free and sends each result back at once; the
queue knows which items each worker holds, so a failure (an item that raised, a worker that
died) names its item. `SavedResults` keeps the results in `run_dir` as they come, so a map run
again starts where it stopped.
"""
from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from pathlib import Path

from ...common import protocol
from ...common.channel import Hub
from ...common.errors import NbtrainError
from ...common.private import check_own, private_dir, read_own, read_own_json, write_private_json
from ...common.tracebacks import readable
from ...rank.work import WorkSpec
from ..run.insight import check_run_dir
from ..run.restarts import why

log = logging.getLogger(__name__)


def item_count(items) -> int | None:
    """How many items, where the iterable says without being iterated (a list, a range); else None."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"items={items!r}: give the items to map over as a list (or any iterable).")
    try:
        return len(items)
    except TypeError:  # an iterator, a generator: counted as it is drawn from
        return None


class MapError(NbtrainError, RuntimeError):
    """An item of a map failed, or the worker running it died (raised by `map` and ``Ranks.map``).

    Parameters
    ----------
    index : int
        The item's position in the input (with ``batch_size`` > 1, the first of its batch).
    summary : str
        The failure in one line.
    traceback : str, default ''
        The worker's own traceback.
    results : dict, optional
        ``{index: result}`` of the items finished before the map stopped (all of them saved in
        ``run_dir``, when one was given: running the map again starts where it stopped).
    total : int, default 0
        Items in the map (0: not known, the items being an iterator not drawn to its end).
    batch : tuple of int, default ()
        Every index of the failed item's batch (default: ``(index,)``).

    Attributes
    ----------
    index, summary, traceback, results, total, batch
        As given.
    """

    def __init__(self, index: int, summary: str, traceback: str = "", results: dict | None = None, total: int = 0,
                 batch: tuple = ()):
        self.index, self.summary, self.traceback = index, summary, traceback
        self.results = dict(results or {})
        self.total = total
        self.batch = tuple(batch) or (index,)
        super().__init__(self._message())

    @property
    def _which(self) -> str:
        if len(self.batch) == 1:
            return f"item {self.index}"
        return f"the batch of items {', '.join(str(i) for i in self.batch)}"  # `map` here is nbtrain's

    def _message(self) -> str:
        text = f"{self._which} failed: {self.summary}"
        if self.total or self.results:
            of = f" of {self.total}" if self.total else ""
            text += f" ({len(self.results)}{of} items done; their results are in .results)"
        if self.traceback:
            text += f"\n\n--- {self._which} ---\n{readable(self.traceback).rstrip()}"
        return text

    def __reduce__(self):
        return (type(self), (self.index, self.summary, self.traceback, self.results, self.total, self.batch))

    def _render_traceback_(self) -> list[str]:
        return [f"MapError: {line}" if i == 0 else line for i, line in enumerate(self._message().splitlines())]


class SavedResults:
    """A map's results in its run directory, as they come: `map.json` (how many items) and
    `results.bin`, a record appended per batch of results (its indices, then the pickled values),
    each written whole. A record cut short by a crash is dropped when read back (and cut off)."""

    HEADER = struct.Struct("!QI")  # payload bytes, number of indices

    def __init__(self, run_dir, total: int | None):
        self.directory = private_dir(Path(check_run_dir(run_dir)))
        meta = self.directory / "map.json"
        if meta.exists():
            held = read_own_json(meta).get("items")
            if held is not None and total is not None and held != total:  # None: items from an iterator
                raise ValueError(f"run_dir={str(run_dir)!r} holds a map of {held} items; this map has {total}. Give "
                                 "another run_dir for a new map (the same run_dir resumes the same map).")
        else:
            write_private_json(meta, {"items": total})
        self.path = self.directory / "results.bin"
        self.payloads: dict[int, tuple[list[int], bytes]] = {}
        if self.path.exists():
            self._read()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        check_own(self.path, "map results")
        self._synced = time.monotonic()

    def _read(self) -> None:
        data, at = read_own(self.path), 0
        while at + self.HEADER.size <= len(data):
            size, count = self.HEADER.unpack_from(data, at)
            end = at + self.HEADER.size + 8 * count + size
            if end > len(data):
                break  # cut short: the kernel died while writing it
            indices = list(struct.unpack_from(f"!{count}Q", data, at + self.HEADER.size))
            payload = data[end - size:end]
            for index in indices:
                self.payloads[index] = (indices, payload)
            at = end
        if at < len(data):
            os.truncate(self.path, at)

    def values(self) -> dict[int, object]:
        import dill

        values, loaded = {}, {}
        for index, (indices, payload) in self.payloads.items():
            key = id(payload)
            if key not in loaded:
                loaded[key] = dict(zip(indices, dill.loads(payload)))
            values[index] = loaded[key][index]
        return values

    def add(self, indices: list[int], payload: bytes) -> None:
        record = self.HEADER.pack(len(payload), len(indices)) + struct.pack(f"!{len(indices)}Q", *indices) + payload
        view, wrote = memoryview(record), 0
        while wrote < len(record):
            wrote += os.write(self._fd, view[wrote:])
        if time.monotonic() - self._synced > 1.0:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


class WorkQueue:
    """The notebook's side of a map: hands out items as workers ask, keeps the results (and saves
    them), and knows which items each worker holds, so a failure names its item."""

    def __init__(self, items, batch_size: int, saved: SavedResults | None, channel: dict, shared_memory: bool = True):
        self.total = item_count(items)  # None: an iterator, counted once it runs out
        # Large tensors in items go as files in shared memory that the worker maps (and removes),
        # as return values come back: pickled through the socket, a 1 GiB item cost the notebook 3 GiB.
        from ...common.tensor_files import LaunchFiles  # torch: imported when a map runs, not with nbtrain

        self._files = LaunchFiles() if shared_memory else None
        self._source = iter(items)  # drawn from only as workers ask: never a list of them all here
        self.batch_size, self.saved = batch_size, saved
        self.results: dict[int, object] = saved.values() if saved is not None else {}
        self.resumed = len(self.results)
        self.taken = 0  # items drawn from the iterable so far (the next one's index)
        self.in_flight: dict[int, list[int]] = {}
        self.failure: MapError | None = None
        self.stopped = False
        self._lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.hub = Hub(self.inbox, **channel)
        self.hub.start()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nbtrain-map-queue", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> int:
        return len(self.in_flight)

    @property
    def finished(self) -> bool:
        return self.total is not None and len(self.results) >= self.total

    def spec(self, fn, bind: bool, worker: int | None = None, threads: int = 0,
             cores: tuple[int, ...] = ()) -> WorkSpec:
        """What a worker runs; `threads`, `cores`: its slot's share of the machine (`slots.py`)."""
        return WorkSpec(self.hub.environ, fn, bind, self.batch_size, worker, threads, cores)

    def ordered(self) -> list:
        return [self.results[i] for i in range(self.total or 0)]

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._handle(message)
            except Exception as exc:  # a result that does not unpickle here: the map cannot go on
                log.debug("map queue", exc_info=True)
                with self._lock:
                    indices = message.indices if isinstance(message, protocol.ItemsDone) else [-1]
                    self._fail(indices, f"its result cannot be read in the notebook: {type(exc).__name__}: {exc}")

    def _handle(self, message) -> None:
        worker = message.rank
        if isinstance(message, protocol.WantItems):
            self.hub.send(worker, self._hand_out(worker, message.count))
        elif isinstance(message, protocol.ItemsDone):
            import dill

            values = dill.loads(message.payload)
            with self._lock:
                if self.saved is not None:
                    try:
                        self.saved.add(message.indices, message.payload)
                    except OSError as exc:  # a full disk, a file-size limit: saving failed, not the item
                        self.in_flight.pop(worker, None)
                        self._fail(message.indices, f"its result came back but could not be saved in "
                                                    f"{self.saved.path}: {exc.strerror or exc}")
                        return
                self.results.update(zip(message.indices, values))
                self.in_flight.pop(worker, None)
        elif isinstance(message, protocol.ItemsFailed):
            with self._lock:
                self.in_flight.pop(worker, None)
                self._fail(message.indices, message.summary, message.traceback)

    def _hand_out(self, worker: int, count: int):
        with self._lock:
            self.in_flight.pop(worker, None)
            batch: list[tuple[int, bytes]] = []
            while len(batch) < count and self.failure is None and not self.stopped:
                index, item = self._next_item()
                if index is None:
                    break
                try:
                    payload = self._pack(index, item)
                except Exception as exc:
                    self._fail([index], f"the item cannot be sent to the workers: {type(exc).__name__}: {exc}")
                    break
                batch.append((index, payload))
            if not batch:
                return protocol.NoMoreItems()
            self.in_flight[worker] = [index for index, _ in batch]
            return protocol.Items(batch)

    def _pack(self, index: int, item) -> bytes:
        """The item pickled as a job travels; its large tensors written to shared memory, where
        one worker maps them (`rank/work.py`), unless the workers may be on other machines."""
        from ...common.tensor_files import RankFiles
        from ...common.transfer import pack_push

        environ = {**os.environ, **self._files.environ} if self._files is not None else {}
        files = RankFiles.from_environ(index, environ)  # named by the item: one worker maps and removes them
        try:
            return pack_push(item, files)
        except BaseException:
            if files is not None:
                files.discard()
            raise

    def _next_item(self) -> tuple[int | None, object]:
        """The next item not done yet (resumed ones are skipped), or (None, None) once there are no more."""
        while self.total is None or self.taken < self.total:
            index = self.taken
            try:
                item = next(self._source)
            except StopIteration:
                self.total = index
                break
            except Exception as exc:
                self._fail([index], f"taking it from the items raised {type(exc).__name__}: {exc}")
                break
            self.taken += 1
            if index not in self.results:
                return index, item
        return None, None

    def _fail(self, indices: list[int], summary: str, traceback: str = "") -> None:
        if self.failure is None:
            self.failure = MapError(indices[0], summary, traceback, total=self.total or 0, batch=tuple(indices))

    def lost(self, worker: int, error: BaseException) -> bool:
        """A worker's run ended in failure; True when it held items (the map then fails, naming the first)."""
        with self._lock:
            indices = self.in_flight.pop(worker, None)
            if indices:
                self._fail(indices, f"its worker failed: {why(error)}", getattr(error, "traceback", ""))
            return bool(indices)

    def error(self) -> MapError | None:
        """The failure, with the results so far."""
        if self.failure is not None:
            self.failure.results, self.failure.total = dict(self.results), self.total or 0
            self.failure.args = (self.failure._message(),)
        return self.failure

    def close(self) -> None:
        self.stopped = True
        self._closing.set()
        self._thread.join(timeout=5.0)
        try:
            while True:  # results that came while the queue was closing are still results
                message = self.inbox.get_nowait()
                if isinstance(message, protocol.ItemsDone):
                    self._handle(message)
        except queue.Empty:
            pass
        self.hub.close()
        if self._files is not None:
            self._files.cleanup()  # the items no worker mapped: a map stopped, a worker that died
        if self.saved is not None:
            self.saved.close()
