"""What a rank tells the doctor: its collectives counted, its step time split, where it is now.

Always on, and cheap enough to be (benchmarks/doctor_overhead.py): each torch.distributed
collective the user's code calls goes through a thin wrapper that counts it (its sequence number,
op, first tensor's shape and dtype, the calling line) and adds its wall time to the rank's
collective wait; `ctx.loader`'s iterator adds the time spent waiting for a batch to the data wait.
Nothing is traced: where a rank is right now is read from its main thread's frame only when the
notebook asks (`whereabouts`, on the channel's receiving thread, which runs while the main
thread waits in a collective or a sleep: both release the GIL).

Not counted: DDP's own gradient all-reduce (its C++ reducer calls the process group directly;
its wait shows in the step's backward, i.e. as compute) and async collectives' waits.
"""
from __future__ import annotations

import linecache
import sys
import threading
import time
from collections import deque

from ..common import protocol
from ..common.tracebacks import package_path

RECENT = 16  # collectives remembered per rank, to name a mismatch across ranks
# torch.distributed's blocking collectives, wrapped where user code finds them (`dist.all_reduce`).
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv")


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

    def reset(self) -> None:
        meeting = self.rendezvous
        self._begin()
        self.rendezvous = meeting  # a live rank's group outlives a command

    def step_times(self, rank: int) -> protocol.StepTimes:
        """The split of this rank's time since the command began, and its recent collectives."""
        total = time.perf_counter() - self.since
        recent = [_described(call) for call in self.recent]
        return protocol.StepTimes(rank, self.batches, total, self.data_s, self.collective_s, recent)


TALLY = Tally()


def _described(call: tuple) -> tuple:
    """A counted call as it travels: its tensor's shape and dtype in words."""
    seq, op, tensor, file, line = call
    if tensor is None:
        return seq, op, None, None, file, line
    shape, dtype = tensor
    return seq, op, tuple(shape), str(dtype).replace("torch.", ""), file, line


def _tensor(args: tuple):
    """(shape, dtype) of the call's tensor: the first argument, or the second (all_gather's list comes first)."""
    for arg in args[:2]:
        shape = getattr(arg, "shape", None)
        if shape is not None:
            return shape, arg.dtype
    return None


def _counted(op: str, collective):
    from torch import Tensor  # a rank has torch already (its Context needs it)

    tally, clock, frame = TALLY, time.perf_counter, sys._getframe

    def counted(*args, **kwargs):
        # Shapes and dtypes are kept as torch gives them (put in words only when asked: `_described`), and
        # never the tensors themselves, which would outlive the call.
        caller = frame(1)
        tally.seq += 1
        first = args[0] if args else None
        tensor = (first.shape, first.dtype) if type(first) is Tensor else _tensor(args)
        call = tally.current = (tally.seq, op, tensor, caller.f_code.co_filename, caller.f_lineno)
        tally.recent.append(call)
        began = clock()
        try:
            return collective(*args, **kwargs)
        finally:
            tally.progressed = ended = clock()
            tally.collective_s += ended - began
            tally.current = None

    counted.__wrapped__ = collective  # type: ignore[attr-defined]
    counted.__name__ = counted.__qualname__ = op
    counted.__doc__ = collective.__doc__
    return counted


def count_collectives() -> None:
    """Wrap torch.distributed's blocking collectives (once per process; forked ranks inherit it)."""
    import torch.distributed as dist

    if not dist.is_available() or getattr(dist, "_nbtrain_counted", False):
        return
    for op in COLLECTIVES:
        collective = getattr(dist, op, None)
        if collective is not None:
            setattr(dist, op, _counted(op, collective))
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    c10d.rendezvous = _noted_rendezvous(c10d.rendezvous)  # type: ignore[attr-defined]  # looked up there at each call
    dist._nbtrain_counted = True  # type: ignore[attr-defined]


def _noted_rendezvous(rendezvous):
    """torch's rendezvous, noting where this rank meets its peers: a rendezvous that never completes
    (code that chose its own address, nobody hosting it) is named by the doctor."""
    def noted(url: str, rank: int = -1, world_size: int = -1, **kwargs):
        TALLY.rendezvous = url.split("?")[0]
        return rendezvous(url, rank, world_size, **kwargs)

    noted.__wrapped__ = rendezvous
    return noted


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


# -- where the rank is, read on request ---------------------------------------------------------

def _user_frame(frame):
    """The innermost frame of the user's own code (not a library's, not nbtrain's), else the innermost."""
    innermost = frame
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and package_path(name) is None:
            return frame
        frame = frame.f_back
    return innermost


def whereabouts(rank: int) -> protocol.Whereabouts:
    """Where this rank's main thread is now, whether it is in a collective, and how long since it progressed."""
    tally = TALLY
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    file, line, code = "", 0, ""
    if frame is not None:
        user = _user_frame(frame)
        file, line = user.f_code.co_filename, user.f_lineno
        code = linecache.getline(file, line).split("  #")[0].strip()  # the code, without a trailing comment
    current = tally.current
    import torch.distributed as dist

    meeting = tally.rendezvous if tally.rendezvous and not dist.is_initialized() else ""
    return protocol.Whereabouts(rank, tally.seq, current and _described(current), file, line, code,
                                time.perf_counter() - tally.progressed, meeting)

