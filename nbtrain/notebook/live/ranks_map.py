"""`Ranks.map`: a map's items handed to the live ranks as each asks (`work_queue.py`), its view
the map's (`display/map_view.py`); `nbtrain.map` says its end in the same words (`outcome`)."""
from __future__ import annotations

import time
import types

from ...common.errors import WorkerError
from ...display.map_view import MapState, make_map_view
from ..run.options import check_count, check_timeout
from .work_queue import SavedResults, WorkQueue, item_count


def said_interrupted(work: WorkQueue, run_dir, stopped: str = "nbtrain stopped every worker") -> str:
    kept = f"; they are saved in {run_dir}: run the map again to go on from there" if run_dir else ""
    of = f" of {work.total}" if work.total is not None else ""
    return f"KeyboardInterrupt: the map was interrupted; {stopped}. {len(work.results)}{of} results were in{kept}."


def outcome(work: WorkQueue, failures: list) -> list:
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
            interrupt._render_traceback_ = lambda: [said_interrupted(work, run_dir, ranks_said)]  # type: ignore[attr-defined]
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
    return outcome(work, [])
