"""What a rank tells the doctor: its collectives counted, its step time split, where it is now.

Always on, and cheap enough to be (benchmarks/doctor_overhead.py): each torch.distributed
collective the user's code calls, or a library does (FSDP2's, DTensor's `scatter`), goes through a
thin wrapper that counts it (its sequence number, op, first tensor's shape and dtype, the user's
line that led to it) and adds its wall time to the rank's collective wait; `ctx.loader`'s
iterator adds the time spent waiting for a batch to the data wait. Nothing is traced: where a
rank is right now is read from its main thread's frame only when the notebook asks
(`whereabouts`, on the channel's receiving thread, which runs while the main thread waits in a
collective or a sleep: both release the GIL).

The counters live in `tally.py` (`TALLY`); DDP's gradient all-reduce, which its C++ reducer issues
inside `backward()`, is counted by `ddp_counting.py` (`count_collectives` installs it too).

Functional collectives (`torch.distributed._functional_collectives`, DTensor's redistribution) issue
torch's C++ ops (`torch.ops._c10d_functional.*`) and return a result waited for at its first use
(`wait_tensor`): they are counted where their Python passes, at the wrapping of that result and at
its wait (`count_functional`), a few microseconds each. Not counted: compiled code's collectives,
whose graph calls those ops itself (nothing Python runs around them). torch 2.13's Flight Recorder
does record them on gloo (TORCH_FR_BUFFER_SIZE) for about a microsecond each, but gloo never marks
an entry started or completed (every one stays "scheduled"), so it cannot tell where a rank waits,
and a dump takes about 0.4 s per 1,000 entries here (5 s with their stacks); its completion hook is
NCCL's only.

A collective called before any process group exists creates the rank's group first (as
`ctx.setup` and ctx's own collectives do): the docs promise the group is made on first need.
"""
from __future__ import annotations

import dis
import functools
import linecache
import sys
import threading
import time

from ..common import protocol
from ..common.import_hooks import when_imported
from .ddp_counting import count_ddp
from .tally import PENDING, TALLY, described, library, timed_batches, user_frame

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv",
               "all_gather_single", "reduce_scatter_single")  # the last two: what FSDP2 calls, async


HOLDERS = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.tensor._collective_utils")


def _tensor(args: tuple):
    """(shape, dtype) of the call's tensor: the first argument, or the second (all_gather's list comes first)."""
    for arg in args[:2]:
        shape = getattr(arg, "shape", None)
        if shape is not None:
            return shape, arg.dtype
    return None


def _make_group() -> None:
    """The rank's default process group, made on first need (nbtrain's ranks know their world)."""
    context = sys.modules.get(__package__ + ".context")
    ctx = getattr(context, "_current", None)
    if ctx is not None:
        ctx._ensure_group()


def counted_collective(op: str, collective):
    """`collective` (torch.distributed's `op`), counted and timed: the wrapper `count_collectives` installs."""
    from torch import Tensor  # a rank has torch already (its Context needs it)
    from torch.distributed import is_initialized

    tally, clock, frame, in_library = TALLY, time.perf_counter, sys._getframe, library

    def counted(*args, **kwargs):
        # Shapes and dtypes are kept as torch gives them (put in words only when asked: `described`), and
        # never the tensors themselves, which would outlive the call.
        if tally.in_hook or tally.current is not None:  # a DDP hook's, or one torch calls inside another
            return collective(*args, **kwargs)
        if not is_initialized():
            _make_group()
        caller = frame(1)
        if in_library(caller.f_code.co_filename):  # FSDP2's, DTensor's, nbtrain's: the user's line that led there
            caller = user_frame(caller)
        tally.seq += 1
        first = args[0] if args else None
        tensor = (first.shape, first.dtype) if type(first) is Tensor else _tensor(args)
        call = tally.current = (tally.seq, op, tensor, caller.f_code.co_filename, caller.f_lineno)
        tally.recent.append(call)
        began = clock()
        try:
            work = collective(*args, **kwargs)
            if kwargs.get("async_op") and (done := getattr(work, "is_completed", None)) is not None:
                tally.pending.append((call, done))
            return work
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
    counted = {op: counted_collective(op, collective) for op in COLLECTIVES
               if (collective := getattr(dist, op, None)) is not None}
    # The modules that hold them by their own names: `dist.all_reduce`, distributed_c10d's (where
    # a module imported later takes them from) and DTensor's (`scatter`, `broadcast`, taken from
    # it at import). Named, not found by reading every module: in a forked rank, walking
    # sys.modules wrote each module's reference count and copied their pages (with Lightning in
    # the kernel, 3,000 modules: 10 ms of a warm 2-rank fork launch's 0.1 s). A collective torch
    # calls inside another is counted as that one.
    for name in HOLDERS:
        namespace = getattr(sys.modules.get(name), "__dict__", {})
        for op, wrapper in counted.items():
            if namespace.get(op) is wrapper.__wrapped__:
                setattr(sys.modules[name], op, wrapper)
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    c10d.rendezvous = _noted_rendezvous(c10d.rendezvous)  # type: ignore[attr-defined]  # looked up there at each call
    count_ddp()
    count_functional()
    dist._nbtrain_counted = True  # type: ignore[attr-defined]


def count_functional() -> None:
    """Count torch's functional collectives (`torch.distributed._functional_collectives`: a user's
    `funcol.all_reduce(t, "sum", group)`, DTensor's redistribution) as they run eagerly, at the two
    Python points every one passes: its result wrapped for a later wait (`_maybe_wrap_tensor`:
    counted, as the collective its caller is named after) and that wait (`wait_tensor`: where the
    rank waits in it, timed). Both are looked up in the module at each call. Compiled code calls
    the C++ ops themselves, reaching neither: its collectives are not counted. Counted once the
    module is imported (by the user, DTensor or FSDP): importing it for every rank cost each 11 ms
    of its start (a warm 2-rank fork launch took 0.106 s instead of 0.089)."""
    when_imported("torch.distributed._functional_collectives", _count_functional_in)


def _count_functional_in(funcol) -> None:
    if not getattr(funcol, "_nbtrain_counted", False):
        funcol._maybe_wrap_tensor, funcol.wait_tensor = functional_counters(
            funcol._maybe_wrap_tensor, funcol.wait_tensor, funcol.AsyncCollectiveTensor)
        funcol._nbtrain_counted = True


def functional_counters(wrap, wait, wrapper) -> tuple:
    """torch's `_maybe_wrap_tensor` and `wait_tensor`, counting: a result wrapped as a `wrapper`
    (not while traced: then it is waited at once, by the graph) is a collective issued, kept by its
    data pointer (as torch pairs a result with its work) until its wait."""
    from torch import Tensor

    tally, clock, frame = TALLY, time.perf_counter, sys._getframe
    issued: dict[int, tuple] = {}

    @functools.wraps(wrap)
    def _maybe_wrap_tensor(tensor):
        result = wrap(tensor)
        if type(result) is not wrapper:
            return result
        caller = frame(1)
        user = user_frame(caller)
        tally.seq += 1
        call = (tally.seq, caller.f_code.co_name, (tensor.shape, tensor.dtype), user.f_code.co_filename,
                user.f_lineno)
        tally.recent.append(call)
        issued[tensor.data_ptr()] = call
        if len(issued) > PENDING:  # results never waited for (dropped unread)
            del issued[next(iter(issued))]
        tally.progressed = clock()
        return result

    @functools.wraps(wait)
    def wait_tensor(tensor):
        if not issued or type(tensor) is not Tensor or tally.current is not None:  # a traced one is fake
            return wait(tensor)
        call = issued.pop(tensor.data_ptr(), None)
        if call is None:
            return wait(tensor)
        tally.current = call
        began = clock()
        try:
            return wait(tensor)
        finally:
            tally.progressed = ended = clock()
            tally.collective_s += ended - began
            tally.current = None

    return _maybe_wrap_tensor, wait_tensor


def _noted_rendezvous(rendezvous):
    """torch's rendezvous, noting where this rank meets its peers: a rendezvous that never completes
    (code that chose its own address, nobody hosting it) is named by the doctor."""
    def noted(url: str, rank: int = -1, world_size: int = -1, **kwargs):
        TALLY.rendezvous = url.split("?")[0]
        return rendezvous(url, rank, world_size, **kwargs)

    noted.__wrapped__ = rendezvous
    return noted


# -- where the rank is, read on request ---------------------------------------------------------

LOADING_FILES = ("torch/utils/data/",)  # frames of a rank waiting for its next batch


def _doing(frame) -> str:
    """What the main thread is doing, in the doctor's words: "loading data" (in a DataLoader or
    ctx.loader's next batch), or, once DDP has reduced a backward(), whether the loop that called
    it still runs ("in the loop", "left the loop"); else ""."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if any(f.f_code is timed_batches.__code__ or any(s in f.f_code.co_filename for s in LOADING_FILES)
           for f in stack):
        return "loading data"
    sites = TALLY.backward_sites
    if not sites:
        return ""
    # The innermost loop around the backward() call, in whichever function of the chain holds
    # one (a train_step() called from the epoch's loop), as the stack stands now.
    for code, lasti in sites:
        loop = _loop_around(code, lasti)
        if loop is None:
            continue
        caller = next((f for f in stack if f.f_code is code), None)
        if caller is None:  # the function with the loop returned: its loop is over
            return "left the loop"
        return "in the loop" if loop[0] <= caller.f_lasti <= loop[1] else "left the loop"
    return ""


def _waiting_in() -> tuple | None:
    """The first async collective or DDP bucket all-reduce that has not completed (read from the
    channel's thread while the main thread may append: a copy is iterated)."""
    return next((call for call, done in list(TALLY.pending) if not done()), None)


@functools.lru_cache(maxsize=64)
def _loop_around(code, offset: int) -> tuple[int, int] | None:
    """The bytecode offsets of the innermost loop around `offset` in `code`: from a backward jump's
    target to the jump; None when `offset` is in no loop."""
    loops = [(i.argval, i.offset) for i in dis.get_instructions(code)
             if isinstance(i.argval, int) and "JUMP" in i.opname and i.argval < i.offset]
    around = [(begin, end) for begin, end in loops if begin <= offset <= end]
    return min(around, key=lambda span: span[1] - span[0]) if around else None


def whereabouts(rank: int) -> protocol.Whereabouts:
    """Where this rank's main thread is now, whether it is in a collective, and how long since it progressed."""
    tally = TALLY
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    file, line, code = "", 0, ""
    if frame is not None:
        user = user_frame(frame)
        file, line = user.f_code.co_filename, user.f_lineno
        code = linecache.getline(file, line).split("  #")[0].strip()  # the code, without a trailing comment
    current = tally.current or _waiting_in()
    import torch.distributed as dist

    meeting = tally.rendezvous if tally.rendezvous and not dist.is_initialized() else ""
    doing = _doing(frame) if frame is not None else ""
    return protocol.Whereabouts(rank, tally.seq, current and described(current), file, line, code,
                                time.perf_counter() - tally.progressed, meeting, tally.backwards, doing, tally.ddp())
