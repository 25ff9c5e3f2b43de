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
from collections import deque

from ...common.errors import WorkerError
from ...common.limits import out_of_files
from ...display.map_view import MapState, make_map_view
from ...rank.work import serve_items
from ..live.ranks_map import outcome, said_interrupted
from ..live.work_queue import MapError, SavedResults, WorkQueue, item_count
from ..run.launch import launch
from ..run.options import RunOptions, check_count
from ..run.restarts import why
from .slots import SlotRunner, plan_slots, slot_start

__all__ = ["MapError", "map"]


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
    options = RunOptions(devices=devices, accelerator=accelerator)  # the options a map shares with launch
    slots, idle = plan_slots(options.devices, 1, options.accelerator, per_slot_name="devices")
    strategy, start = slot_start(options)
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
            check_queue_accepts()
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

    def check_queue_accepts() -> None:
        """A worker the map's queue has no file descriptor to accept would retry for 30 s, then fail
        as unreachable: the open-file limit is said at once instead."""
        if work.hub.out_of_files is not None:
            raise out_of_files(work.hub.out_of_files, "accepting the workers' connections to the map's queue",
                               len(slots), len(slots), f"the map's {len(slots)} workers")

    def tick() -> None:
        check_queue_accepts()
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
        interrupt._render_traceback_ = lambda: [said_interrupted(work, run_dir)]  # type: ignore[attr-defined]
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
    return outcome(work, failures)
