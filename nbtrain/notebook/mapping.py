"""`nbtrain.map` and `Ranks.map`: a function over many items, on workers that take the next items
whenever they are free (a work queue, not a static split), results back in input order.

    embeddings = nbtrain.map(embed, texts, devices="auto")       # a worker per device, each its own process
    predictions = ranks.map(predict, batches)                    # live ranks: `predict` sees their `model`

`nbtrain.map` runs one worker per device slot (`slots.py`: each a launch of its own, so its own
world); `Ranks.map` runs one on each live rank, as one `call` command, with the rank's namespace
as the function's globals (a model loaded or trained there is used as it is). Either way the
workers take items from this module's `WorkQueue` (a channel of its own beside the run's, see
`rank/work.py`), results stream back as they are done, and with `run_dir` are saved privately as
they come, so a map run again after an interruption starts where it stopped.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import struct
import threading
import time
import types
from collections import deque
from pathlib import Path

from ..common.channel import Hub
from ..common.errors import WorkerError
from ..common.private import check_own, private_dir, read_own, read_own_json, write_private_json
from ..common.tracebacks import readable
from ..display.map_view import MapState, make_map_view
from ..rank.work import WorkSpec, serve_items
from .insight import check_run_dir
from .launch import check_timeout, launch
from .restarts import why
from .slots import SlotRunner, check_count, plan_slots, slot_strategy

log = logging.getLogger(__name__)


class MapError(RuntimeError):
    """An item of a map failed, or the worker running it died.

    `index`: the item's position in the input (with batch_size > 1, the first of its batch;
    `batch` lists them all); `summary`: its first line; `traceback`: the worker's own; `results`:
    {index: result} of the items finished before the map stopped (all of them saved in `run_dir`,
    when one was given: running the map again starts where it stopped).
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
        if self.total:
            text += f" ({len(self.results)} of {self.total} items done; their results are in .results)"
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

    def __init__(self, run_dir, total: int):
        self.directory = private_dir(Path(check_run_dir(run_dir)))
        meta = self.directory / "map.json"
        if meta.exists():
            held = read_own_json(meta).get("items")
            if held != total:
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

    def __init__(self, items: list, batch_size: int, saved: SavedResults | None, channel: dict):
        self.items, self.batch_size, self.saved = items, batch_size, saved
        self.results: dict[int, object] = saved.values() if saved is not None else {}
        self.resumed = len(self.results)
        self.pending = deque(i for i in range(len(items)) if i not in self.results)
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
        return len(self.results) == len(self.items)

    def spec(self, fn, bind: bool, worker: int | None = None) -> WorkSpec:
        return WorkSpec(self.hub.environ, fn, bind, self.batch_size, worker)

    def ordered(self) -> list:
        return [self.results[i] for i in range(len(self.items))]

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
                    indices = message[2] if message[0] == "result" else [-1]
                    self._fail(indices, f"its result cannot be read in the notebook: {type(exc).__name__}: {exc}")

    def _handle(self, message: tuple) -> None:
        kind, worker = message[0], message[1]
        if kind == "need":
            self.hub.send(worker, self._hand_out(worker, message[2]))
        elif kind == "result":
            import dill

            indices, payload = message[2], message[3]
            values = dill.loads(payload)
            with self._lock:
                if self.saved is not None:
                    self.saved.add(indices, payload)
                self.results.update(zip(indices, values))
                self.in_flight.pop(worker, None)
        elif kind == "error":
            indices, summary, traceback = message[2], message[3], message[4]
            with self._lock:
                self.in_flight.pop(worker, None)
                self._fail(indices, summary, traceback)

    def _hand_out(self, worker: int, count: int) -> tuple:
        import dill

        with self._lock:
            self.in_flight.pop(worker, None)
            batch = []
            while self.pending and len(batch) < count and self.failure is None and not self.stopped:
                index = self.pending[0]
                try:
                    payload = dill.dumps(self.items[index], recurse=True)
                except Exception as exc:
                    self._fail([index], f"the item cannot be sent to the workers: {type(exc).__name__}: {exc}")
                    break
                self.pending.popleft()
                batch.append((index, payload))
            if not batch:
                return ("done",)
            self.in_flight[worker] = [index for index, _ in batch]
            return ("items", batch)

    def _fail(self, indices: list[int], summary: str, traceback: str = "") -> None:
        if self.failure is None:
            self.failure = MapError(indices[0], summary, traceback, total=len(self.items), batch=indices)

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
            self.failure.results = dict(self.results)
            self.failure.args = (self.failure._message(),)
        return self.failure

    def close(self) -> None:
        self.stopped = True
        self._closing.set()
        self._thread.join(timeout=5.0)
        try:
            while True:  # results that came while the queue was closing are still results
                message = self.inbox.get_nowait()
                if message[0] == "result":
                    self._handle(message)
        except queue.Empty:
            pass
        self.hub.close()
        if self.saved is not None:
            self.saved.close()


def _items(items) -> list:
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"items={items!r}: give the items to map over as a list (or any iterable).")
    return list(items)


def map(fn, items, *, devices="auto", batch_size: int = 1, accelerator: str = "auto", run_dir=None,
        progress=True) -> list:
    """`[fn(item) for item in items]`, run by a worker process per device slot, in input order.

    Each worker is its own launch on one device (`devices`: launch's grammar; "auto" is every
    visible GPU, on CPU give a number of worker processes), and takes the next items whenever it
    is free, so a worker given quick items does more of them. With `batch_size` > 1, `fn` takes a
    list of up to that many items and returns one result per item. A failing item raises
    `MapError` naming its index, with its traceback and the results so far. With `run_dir`, results
    are saved (privately) as they come, and the same map run again starts where it stopped.
    Ctrl-C stops every worker, leaving nothing.
    """
    if not callable(fn):
        raise TypeError(f"map(fn=...) needs a callable, got {type(fn).__name__}.")
    items = _items(items)
    check_count(batch_size, "batch_size")
    view = make_map_view(progress)
    slots, idle = plan_slots(devices, 1, accelerator, per_slot_name="devices")
    strategy, options = slot_strategy("auto", 1)
    saved = SavedResults(run_dir, len(items)) if run_dir is not None else None
    work = WorkQueue(items, batch_size, saved, {})
    kind = "GPU" if slots[0].accelerator == "gpu" else "CPU"
    state = MapState(f"map of {getattr(fn, '__name__', 'fn')} on {len(slots)} {kind} slot{'s' if len(slots) > 1 else ''}",
                     len(items), work.resumed, len(work.results))
    failures: list[BaseException] = []
    lines: deque = deque()  # the workers' output, shown by the main thread

    def serve(slot) -> bool:
        if work.finished or work.failure is not None:
            return False
        display = None
        try:
            display = runner.display(on_output=lambda rank, stream, text: lines.append((f"[{slot}] {text}", stream)),
                                     on_note=lambda text: lines.append((f"nbtrain: {slot}: {text}", "stdout")))
            launch(functools.partial(serve_items, work.spec(fn, bind=False, worker=slot.index)),
                   devices=slot.launch_devices, accelerator=slot.accelerator, strategy=strategy,
                   launcher_options=options, progress=display)
        except WorkerError as error:
            if not work.lost(slot.index, error):  # it held no item: the others go on
                failures.append(error)
                lines.append((f"nbtrain: the worker on {slot} failed: {why(error)}", "stderr"))
        finally:
            if display is not None:
                display.release()
        return False  # a worker serves until the queue is empty: its slot has nothing more to do

    def tick() -> None:
        while lines:
            view.output(*lines.popleft())
        state.done, state.busy = len(work.results), work.busy
        view.update(state)
        if work.failure is not None:
            runner.stop()

    runner = SlotRunner(slots, serve)
    view.start(state)
    if idle:
        view.output(f"nbtrain: {idle}")
    verdict = "finished"
    try:
        if not work.finished:
            runner.run(tick)
    except KeyboardInterrupt as interrupt:
        verdict = "interrupted"
        interrupt._render_traceback_ = lambda: [_interrupted(work, run_dir)]
        raise
    except BaseException:
        verdict = "failed"
        raise
    finally:
        work.close()
        while lines:
            view.output(*lines.popleft())
        state.done, state.busy, state.ended = len(work.results), 0, time.monotonic()
        if verdict == "finished" and not work.finished:
            verdict = "failed"
        view.finish(state, verdict)
    return _outcome(work, failures)


def _interrupted(work: WorkQueue, run_dir) -> str:
    kept = f"; they are saved in {run_dir}: run the map again to go on from there" if run_dir else ""
    return (f"KeyboardInterrupt: the map was interrupted; nbtrain stopped every worker. {len(work.results)} of "
            f"{len(work.items)} results were in{kept}.")


def _outcome(work: WorkQueue, failures: list) -> list:
    error = work.error()
    if error is not None:
        raise error
    if not work.finished:  # every worker failed before taking an item
        if failures:
            raise failures[0]
        raise RuntimeError(f"the map ended with {len(work.items) - len(work.results)} items not done")
    return work.ordered()


_WORKER_SOURCE = (  # names only builtins: the rank's namespace is its globals (see `ranks_worker`)
    'def _nbtrain_map_worker(spec):\n'
    '    return getattr(__import__("nbtrain.rank.work", None, None, ["serve_items"]), "serve_items")(spec, globals())\n')


def ranks_worker(fn: types.FunctionType) -> types.FunctionType:
    """The function a live rank runs for `Ranks.map`: the work loop, bound there to the rank's
    namespace. `fn`'s code rides along as a constant of its code, so the names `fn` reads that the
    rank lacks are fetched from the notebook (as `Ranks.run` fetches its function's), never the
    names the rank holds (its model)."""
    namespace: dict = {}
    exec(compile(_WORKER_SOURCE, "<nbtrain map>", "exec"), namespace)
    code = namespace["_nbtrain_map_worker"].__code__
    code = code.replace(co_consts=code.co_consts + (fn.__code__,))
    return types.FunctionType(code, fn.__globals__, "_nbtrain_map_worker")


class _RanksDisplay:
    """The map's view as the live ranks' command display: their output tagged, the bar redrawn, and
    the command interrupted (the ranks keep their state) once an item failed."""

    def __init__(self, view, state: MapState, work: WorkQueue):
        self.view, self.state, self.work = view, state, work

    def start(self, state) -> None:
        pass

    def note(self, text: str) -> None:
        self.view.output(f"nbtrain: {text}")

    def output(self, rank, stream: str, text: str) -> None:
        self.view.output(text if rank is None else f"[rank {rank}] {text}", stream)

    def update(self, state) -> None:
        self.state.done, self.state.busy = len(self.work.results), self.work.busy
        self.view.update(self.state)
        if self.work.failure is not None:
            raise KeyboardInterrupt  # the supervisor interrupts the ranks; they keep their state

    def finish(self, state, ok: bool) -> None:
        pass


def map_on_ranks(ranks, fn, items, *, batch_size: int = 1, run_dir=None, progress=True,
                 timeout: float | None = None) -> list:
    """`Ranks.map`: see there."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"map(fn, items) on live ranks takes a Python function, got {type(fn).__name__}.")
    items = _items(items)
    check_count(batch_size, "batch_size")
    check_timeout(timeout)
    view = make_map_view(progress)
    if ranks.closed:
        ranks.eval("None")  # raises, saying how to get ranks again
    pool = ranks._pool
    saved = SavedResults(run_dir, len(items)) if run_dir is not None else None
    work = WorkQueue(items, batch_size, saved, pool.launcher.channel_options(pool.job))
    state = MapState(f"map of {fn.__name__} on {ranks.world_size} live ranks", len(items), work.resumed,
                     len(work.results))
    bare = types.FunctionType(fn.__code__, {}, fn.__name__, fn.__defaults__, fn.__closure__)
    bare.__kwdefaults__, bare.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    view.start(state)
    verdict = "finished"
    try:
        if not work.finished:
            ranks.run(ranks_worker(fn), work.spec(bare, bind=True), progress=_RanksDisplay(view, state, work),
                      timeout=timeout)
    except KeyboardInterrupt as interrupt:
        if work.failure is None:
            verdict = "interrupted"
            interrupt._render_traceback_ = lambda: [_interrupted(work, run_dir)]
            raise
        verdict = "failed"
    except WorkerError as error:
        verdict = "failed"
        if not work.lost(error.rank, error):
            raise
    finally:
        work.close()
        state.done, state.busy, state.ended = len(work.results), 0, time.monotonic()
        if verdict == "finished" and work.failure is not None:
            verdict = "failed"
        view.finish(state, verdict)
    return _outcome(work, [])
