"""`nbtrain.map` and `Ranks.map`: a function over many items, on workers that take the next items
whenever they are free (a work queue, not a static split), results back in input order.

    embeddings = nbtrain.map(embed, texts, devices="auto")       # a worker per device, each its own process
    predictions = ranks.map(predict, batches)                    # live ranks: `predict` sees their `model`

`nbtrain.map` runs one worker per device slot (`slots.py`: each a launch of its own, so its own
world); `Ranks.map` runs one on each live rank, as one `call` command, with the rank's namespace
as the function's globals (a model loaded or trained there is used as it is). Either way the
workers take items from a `WorkQueue` (`work_queue.py`: a channel of its own beside the run's, see
`rank/work.py`), results stream back as they are done, and with `run_dir` are saved privately as
they come, so a map run again after an interruption starts where it stopped.
"""
from __future__ import annotations

import functools
import time
import types
from collections import deque

from ..common.errors import WorkerError
from ..common.limits import out_of_files
from ..display.map_view import MapState, make_map_view
from ..rank.work import serve_items
from .launch import check_timeout, launch
from .restarts import why
from .slots import SlotRunner, check_count, plan_slots, slot_start
from .work_queue import MapError, SavedResults, WorkQueue, item_count

__all__ = ["MapError", "map", "map_on_ranks"]


def map(fn, items, *, devices="auto", batch_size: int = 1, accelerator: str = "auto", run_dir=None,
        progress=True) -> list:
    """``[fn(item) for item in items]``, run by one worker process per device, results in input order.

    Each worker is a launch of its own on one device (ranks from the warm template) and takes
    the next items whenever it is free, so a worker given quick items does more of them. One
    live view (a bar) shows the whole map; Ctrl-C stops every worker, leaving nothing.

    Parameters
    ----------
    fn : callable
        The function; it may be defined in the notebook.
    items : iterable
        What to map over: a list, or any iterable, even an endless one (``itertools.count()``):
        items are drawn from it only as workers ask for them.
    devices : int, str or list, default 'auto'
        As for `launch`: one worker per device ('auto': every visible GPU); on CPU, a number of
        worker processes.
    batch_size : int, default 1
        With more than 1, ``fn`` takes a list of up to that many items and returns one result per item.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        As for `launch`.
    run_dir : str or Path, optional
        Save the results (privately) as they come; the same map run again starts where it stopped.
    progress : bool or str, default True
        As for `launch`.

    Returns
    -------
    list
        ``fn``'s result for each item, in input order.

    Raises
    ------
    MapError
        An item failed, or the worker running it died: its index, traceback and the results so far.
    TypeError
        ``fn`` is not callable, or ``items`` not iterable.
    ValueError
        A setting is not accepted.
    KeyboardInterrupt
        Ctrl-C: every worker was stopped (with ``run_dir``, what was done is kept).
    """
    if not callable(fn):
        raise TypeError(f"map(fn=...) needs a callable, got {type(fn).__name__}.")
    total = item_count(items)
    check_count(batch_size, "batch_size")
    view = make_map_view(progress)
    slots, idle = plan_slots(devices, 1, accelerator, per_slot_name="devices")
    strategy, start = slot_start()
    saved = SavedResults(run_dir, total) if run_dir is not None else None
    work = WorkQueue(items, batch_size, saved, {})
    kind = "GPU" if slots[0].accelerator == "gpu" else "CPU"
    state = MapState(f"map of {getattr(fn, '__name__', 'fn')} on {len(slots)} {kind} "
                     f"slot{'s' if len(slots) > 1 else ''}",
                     total, work.resumed, len(work.results))
    failures: list[BaseException] = []
    lines: deque = deque()  # the workers' output, shown by the main thread

    def serve(slot) -> bool:
        if work.finished or work.failure is not None:
            return False
        display = None
        try:
            display = runner.display(on_output=lambda rank, stream, text: lines.append((f"[{slot}] {text}", stream)),
                                     on_note=lambda text: lines.append((f"nbtrain: {slot}: {text}", "stdout")))
            spec = work.spec(fn, bind=False, worker=slot.index, threads=slot.threads, cores=slot.cores)  # its share
            launch(functools.partial(serve_items, spec),
                   devices=slot.launch_devices, accelerator=slot.accelerator, strategy=strategy, start=start,
                   progress=display)
        except WorkerError as error:
            if not work.lost(slot.index, error):  # it held no item: the others go on
                failures.append(error)
                lines.append((f"nbtrain: the worker on {slot} failed: {why(error)}", "stderr"))
        except OSError as error:  # out of open files: said for the whole map, each worker a launch
            raise out_of_files(error, getattr(error, "step", "starting a worker"), len(slots), len(slots),
                               f"the map's {len(slots)} workers") from error
        finally:
            if display is not None:
                display.release()
        return False  # a worker serves until the queue is empty: its slot has nothing more to do

    def tick() -> None:
        while lines:
            view.output(*lines.popleft())
        state.done, state.busy, state.total = len(work.results), work.busy, work.total
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
        interrupt._render_traceback_ = lambda: [_interrupted(work, run_dir)]  # type: ignore[attr-defined]
        raise
    except BaseException:
        verdict = "failed"
        raise
    finally:
        work.close()
        while lines:
            view.output(*lines.popleft())
        state.done, state.busy, state.total, state.ended = len(work.results), 0, work.total, time.monotonic()
        if verdict == "finished" and not work.finished:
            verdict = "failed"
        view.finish(state, verdict)
    return _outcome(work, failures)


def _interrupted(work: WorkQueue, run_dir, stopped: str = "nbtrain stopped every worker") -> str:
    kept = f"; they are saved in {run_dir}: run the map again to go on from there" if run_dir else ""
    of = f" of {work.total}" if work.total is not None else ""
    return f"KeyboardInterrupt: the map was interrupted; {stopped}. {len(work.results)}{of} results were in{kept}."


def _outcome(work: WorkQueue, failures: list) -> list:
    error = work.error()
    if error is not None:
        raise error
    if not work.finished:  # every worker failed before taking an item
        if failures:
            raise failures[0]
        raise RuntimeError(f"the map ended with {len(work.results)} of {work.total or 'its'} items done")
    return work.ordered()


_WORKER_SOURCE = (  # names only builtins: the rank's namespace is its globals (see `ranks_worker`)
    'def _nbtrain_map_worker(spec):\n'
    '    return getattr(__import__("nbtrain.rank.work", None, None, ["serve_items"]),\n'
    '                   "serve_items")(spec, globals())\n')


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
        self.state.done, self.state.busy, self.state.total = len(self.work.results), self.work.busy, self.work.total
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
    total = item_count(items)
    check_count(batch_size, "batch_size")
    check_timeout(timeout)
    view = make_map_view(progress)
    if ranks.closed:
        ranks.eval("None")  # raises, saying how to get ranks again
    pool = ranks._pool
    saved = SavedResults(run_dir, total) if run_dir is not None else None
    work = WorkQueue(items, batch_size, saved, pool.channel_options(), shared_memory=not pool.remote)
    state = MapState(f"map of {fn.__name__} on {ranks.world_size} live ranks", total, work.resumed,
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
            said = interrupt._render_traceback_()[0] if hasattr(interrupt, "_render_traceback_") else ""
            ranks_said = said.removeprefix("KeyboardInterrupt: ").rstrip(".") or "the live ranks were interrupted"
            interrupt._render_traceback_ = lambda: [_interrupted(work, run_dir, ranks_said)]  # type: ignore[attr-defined]
            raise
        verdict = "failed"
    except WorkerError as error:
        verdict = "failed"
        if not work.lost(error.rank, error):
            raise
    finally:
        work.close()
        state.done, state.busy, state.total, state.ended = len(work.results), 0, work.total, time.monotonic()
        if verdict == "finished" and work.failure is not None:
            verdict = "failed"
        view.finish(state, verdict)
    return _outcome(work, [])
