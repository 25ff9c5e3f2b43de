"""A rank's tally for the doctor: its counters (`TALLY`: collectives, step time split, DDP's
forwards and backward()s), the signs of progress (`progressed`, `timed_batches`: `ctx.loader`'s
iterator adds the time spent waiting for a batch to the data wait), and which frames are the user's
own (`user_frame`). What fills it: `doctor.py` (collectives counted, where a rank is) and
`ddp_counting.py` (DDP's gradient all-reduce)."""
from __future__ import annotations

import functools
import time
from collections import deque

from ..common import protocol
from ..common.tracebacks import package_path

RECENT = 16  # collectives remembered per rank, to name a mismatch across ranks
NAMES_SHOWN = 4  # a bucket's parameters named in a call; the rest counted
PENDING = 64  # async collectives and DDP buckets kept until done, to tell where a rank waits


class Tally:
    """This rank's counters (one per process: `TALLY`). Plain attributes, touched by the main thread only."""

    def __init__(self) -> None:
        self._begin()

    def _begin(self) -> None:
        self.seq = 0  # collectives called so far
        self.current: tuple | None = None  # the collective the main thread is in: (seq, op, (shape, dtype), file, line)
        self.recent: deque = deque(maxlen=RECENT)  # the last collectives, as `current`
        self.collective_s = 0.0  # wall time inside collectives
        self.data_s = 0.0  # wall time waiting for ctx.loader's next batch
        self.batches = 0
        self.since = time.perf_counter()  # when these counters began (the command's start)
        self.progressed = self.since  # the last sign of progress: a collective or a batch done, a progress step
        self.rendezvous = ""  # the address the rank's init_process_group meets its peers at (until it has a group)
        self.backwards = 0  # backward() calls whose gradients DDP all-reduced (every DDP model of the rank)
        # The last such backward()'s user frame (file, line), and the call sites around it, outward:
        # ((code, lasti), ...), to tell whether the loop that called it still runs.
        self.backward_at: tuple | None = None
        self.backward_sites: tuple = ()
        # Async collectives (FSDP2's, a user's async_op=True) and DDP's buckets, as (call, its `done`):
        # the first not done is where the rank waits, in `work.wait()` or inside backward().
        self.pending: deque = deque(maxlen=PENDING)
        self.in_hook = False  # a DDP hook runs: its own collectives are the bucket's, counted as one
        # DDP's training forwards (grad enabled), every DDP model of the rank: a backward() whose
        # gradients were never all-reduced is told from them (a skipped backward(), no_sync(), an unused parameter).
        self.forwards = 0  # whose gradients DDP all-reduces in the backward() that follows
        self.unsynced = 0  # under no_sync()
        self.skipped = 0  # of `forwards`, those no backward() followed before the next
        self.awaiting = False  # the last of `forwards` has had no backward() yet
        self.model = None  # a weak reference to the DDP model of the last of `forwards`
        self.backward_called_at: tuple | None = None  # the user's line of the last backward() call

    def reset(self) -> None:
        meeting = self.rendezvous
        self._begin()
        self.rendezvous = meeting  # a live rank's group outlives a command

    def step_times(self, rank: int) -> protocol.StepTimes:
        """The split of this rank's time since the command began, and its recent collectives."""
        total = time.perf_counter() - self.since
        recent = [described(call) for call in self.recent]
        return protocol.StepTimes(rank, self.batches, total, self.data_s, self.collective_s, recent, self.ddp())

    def ddp(self) -> tuple:
        """(training forwards, under no_sync(), not followed by backward(), the names of the last
        model's parameters without a gradient) once a DDP model ran forward; else ()."""
        if not (self.forwards or self.unsynced):
            return ()
        model = self.model() if self.model is not None else None
        unused = _gradless(model) if model is not None and self.forwards > self.backwards else ""
        return self.forwards, self.unsynced, self.skipped + self.awaiting, unused


TALLY = Tally()


def described(call: tuple) -> tuple:
    """A counted call as it travels: its tensor's shape and dtype in words; a DDP bucket's call
    also carries (backward() number, bucket index, its parameters' names)."""
    seq, op, tensor, file, line, *ddp = call
    if tensor is None:
        return seq, op, None, None, file, line, *ddp
    shape, dtype = tensor
    return seq, op, tuple(shape), str(dtype).replace("torch.", ""), file, line, *ddp


def _gradless(model) -> str:
    """The names of a DDP model's trained parameters that have no gradient, when some have one
    (those its forwards never used); "" when none or all have none."""
    trained = [(n, p.grad is None) for n, p in model.module.named_parameters() if p.requires_grad]
    names = [n for n, none in trained if none]
    return names_words(names) if len(names) < len(trained) else ""


def names_words(names: list[str]) -> str:
    """Parameters' names as a call shows them: the first few, the rest counted."""
    more = len(names) - NAMES_SHOWN
    return ", ".join(names[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def timed_batches(iterator):
    """`iterator`'s items, the wait for each added to the rank's data wait."""
    tally, clock = TALLY, time.perf_counter
    while True:
        began = clock()
        try:
            item = next(iterator)
        except StopIteration:
            return
        tally.data_s += clock() - began
        tally.batches += 1
        tally.progressed = clock()
        yield item


def progressed() -> None:
    """A sign of progress from the rank's code (a step of `ctx.progress`)."""
    TALLY.progressed = time.perf_counter()


# -- whose frame is whose ----------------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def library(name: str) -> bool:
    """Whether a file is a library's (an installed package's, nbtrain's, frozen), not the user's."""
    return name.startswith("<frozen") or package_path(name) is not None


def user_frame(frame):
    """The innermost frame of the user's own code (not a library's, not nbtrain's), else the innermost."""
    innermost = frame
    while frame is not None:
        if not library(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return innermost
