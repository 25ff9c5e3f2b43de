"""A rank's step boundaries: `ctx.progress` loops, `ctx.step()`, and what acts at them.

An iteration of the innermost `progress` loop is a step (unless the code calls `step()` itself);
at each step the profiler's window moves (`profiling.py`) and a run in the background may be
steered (`steer.py`: `run.pause()` holds here). Each loop also reports its progress to the
notebook's live view. `StepBoundaries` adds these methods to `Context`.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Iterator

from ..common import protocol
from .place import RankPlace
from .tally import progressed

PROGRESS_INTERVAL = 0.1  # seconds between progress events of one bar


class StepBoundaries(RankPlace):
    """`Context`'s step boundaries and progress loops (documented there)."""

    def _observe(self, trackers, recorder) -> None:
        """Attach (or, with None, detach) the trackers and the profiler of the command starting now."""
        self._trackers, self._recorder = trackers, recorder
        self._deepest, self._explicit_steps = -1, False
        if recorder is not None:
            recorder.start()

    def step(self) -> bool:
        """Mark the end of one training step: for a profile's window (``launch(..., profile=...)``),
        and as the step boundary where a run in the background is steered (`run.pause()` holds here).

        Without calls to it, each iteration of the innermost `progress` loop is a step.

        Returns
        -------
        bool
            True once ``run.stop()`` asked the training to end: a loop of your own ends then
            (`progress` loops end by themselves).
        """
        self._explicit_steps = True
        if self._recorder is not None:
            self._recorder.step()
        steering = self._steering
        steering.steps += 1
        return steering.pending and steering.at_boundary(True)

    def steer(self, **objects) -> None:
        """Register what a run in the background may be steered with, by name: ``run.call(fn)``
        passes them to ``fn`` by its parameters' names, ``run.set(lr=...)`` changes registered
        optimizers, ``run.checkpoint(path)`` saves them all.

        Parameters
        ----------
        **objects
            The training's objects: ``ctx.steer(model=model, optimizer=opt)``. Registering a
            name again replaces it.

        Raises
        ------
        ValueError
            No objects given, or a name that `run.call` offers itself (``ctx``, ``step``).
        """
        if not objects:
            raise ValueError("ctx.steer() needs the objects to register by name: ctx.steer(model=model, optimizer=opt)")
        taken = sorted({"ctx", "step"} & objects.keys())
        if taken:
            raise ValueError(f"ctx.steer({taken[0]}=...): {taken} is offered to run.call's functions already; "
                             "register it under another name.")
        self._steering.objects.update(objects)

    def _begin_command(self) -> None:
        # A live rank runs many commands: each one's progress bars start at the outer level.
        self._depth = 0
        self._steering.reset()

    def progress(self, iterable: Iterable, desc: str | None = None, total: int | None = None,
                 initial: int = 0) -> Iterator:
        """Iterate, reporting this rank's progress to the notebook's live view (nested calls nest).

        Parameters
        ----------
        iterable : iterable
            What to iterate over.
        desc : str, optional
            The bar's label; default 'epoch' for the outer loop, 'batch' inside it.
        total : int, optional
            Iterations in all; default ``initial + len(iterable)`` when it has a length (unlike
            tqdm: the iterable of a resumed loop is what is left).
        initial : int, default 0
            Iterations done before this loop, as in tqdm: a loop resumed from a checkpoint,
            ``ctx.progress(range(start, steps), initial=start)``, reads start..steps, and its
            rate and ETA count only the iterations done now.

        Returns
        -------
        iterator
            The iterable's items.

        Raises
        ------
        ValueError
            ``initial`` is not an int >= 0.
        """
        try:  # numpy's integers and a 0-d integer tensor (a step read back from a checkpoint) are ints too
            count = None if isinstance(initial, bool) else operator.index(initial)
        except TypeError:
            count = None
        if count is None or count < 0:
            raise ValueError(f"ctx.progress(initial={initial!r}): initial must be an int >= 0 (the iterations "
                             f"done before this loop, e.g. the step a checkpoint resumed from)")
        initial = count
        if total is None:
            try:
                total = initial + len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        return self._progress(iterable, desc, total, initial)

    def _progress(self, iterable: Iterable, desc: str | None, total: int | None, initial: int) -> Iterator:
        level = self._depth
        desc = desc or ("epoch" if level == 0 else "batch")
        self._depth += 1
        self._deepest = max(self._deepest, level)
        emit, rank = self._sink.emit, self.rank
        # Each event carries this rank's own clock: rates are told from when the steps happened
        # here, not from when batches of events reached the notebook. Each also carries `initial`,
        # where this loop began: the notebook tells a new loop by it, and counts only the steps after it.
        n, last = initial, time.monotonic()
        emit(protocol.Progress(rank, level, desc, n, total, False, last, initial))
        steering = self._steering
        try:
            if steering.stopping:  # run.stop(): a loop that begins after it has nothing left to do
                return
            for item in iterable:
                yield item
                n += 1
                progressed()
                counted = level == self._deepest and not self._explicit_steps  # a step boundary
                if counted:
                    steering.steps += 1
                    if self._recorder is not None:
                        self._recorder.step()
                if steering.pending and steering.at_boundary(counted):
                    break  # run.stop(): as if the loop had finished
                now = time.monotonic()
                if now - last >= PROGRESS_INTERVAL:
                    emit(protocol.Progress(rank, level, desc, n, total, False, now, initial))
                    last = now
        finally:
            self._depth -= 1
            emit(protocol.Progress(rank, level, desc, n, total, True, time.monotonic(), initial))
