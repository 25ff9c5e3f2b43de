"""What a rank tells the doctor: its collectives counted, its step time split, where it is now.

Always on, and cheap enough to be (benchmarks/doctor_overhead.py): each torch.distributed
collective the user's code calls, or a library does (FSDP2's, DTensor's `scatter`), goes through a
thin wrapper that counts it (its sequence number, op, first tensor's shape and dtype, the user's
line that led to it) and adds its wall time to the rank's collective wait; `ctx.loader`'s
iterator adds the time spent waiting for a batch to the data wait. Nothing is traced: where a
rank is right now is read from its main thread's frame only when the notebook asks
(`whereabouts`, on the channel's receiving thread, which runs while the main thread waits in a
collective or a sleep: both release the GIL).

DDP's gradient all-reduce, which its C++ reducer issues inside `backward()`, is counted through a
communication hook (`count_ddp`): every DistributedDataParallel built in a rank process, nbtrain's
(`ctx.setup`) or the user's own, gets one at its first forward. The hook is torch's default
all-reduce (the same division, the same call, the same result) behind a slot a user's own
`register_comm_hook` fills, so a user's hook still runs, counted the same way. It notes each
bucket's call (sequence number, backward() number, bucket index, its parameters' names, the user's
line of that `backward()`) and keeps the bucket's future: a bucket whose future is not done is
where the rank waits, as an async collective's work not completed is (FSDP2's all-gathers and
reduce-scatters, `all_gather_single` and `reduce_scatter_single`, are counted that way).
Registering at the first forward (a one-shot pre-hook, nothing per step) rather than at
construction leaves a user's own hook, and a Join that changes how DDP divides, their say (see
`count_ddp`); a hook the user gives later fills the slot instead of failing. Its wait
still shows in the step's backward (as compute), and async collectives' waits are not timed.

A backward() a rank never all-reduced while others wait in its all-reduce has three causes besides
fewer batches, told apart by each DDP model's training forwards (counted in DDP's `_pre_forward`,
under no_sync() or not) and the `backward()` calls (torch.autograd.backward wrapped): a forward no
backward() followed, a forward under no_sync() the others did not make, and a backward() that left a
parameter without a gradient (find_unused_parameters=False: DDP then never all-reduces it; torch
raises at the next forward, and its error is given the parameters' names and the fix first).

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
import re
import sys
import threading
import time
import weakref
from collections import deque

from ..common import protocol
from ..common.tracebacks import package_path, place_name

RECENT = 16  # collectives remembered per rank, to name a mismatch across ranks
DDP_OP = "DDP's gradient all-reduce"  # a bucket's all-reduce, as a counted call's op
NAMES_SHOWN = 4  # a bucket's parameters named in a call; the rest counted
SETTLE_BACKWARDS = 2  # DDP rebuilds its buckets once, after the first backward(): names read until then
# torch.distributed's blocking collectives, wrapped where user code finds them (`dist.all_reduce`).
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv",
               "all_gather_single", "reduce_scatter_single")  # the last two: what FSDP2 calls, async
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
        recent = [_described(call) for call in self.recent]
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


def _described(call: tuple) -> tuple:
    """A counted call as it travels: its tensor's shape and dtype in words; a DDP bucket's call
    also carries (backward() number, bucket index, its parameters' names)."""
    seq, op, tensor, file, line, *ddp = call
    if tensor is None:
        return seq, op, None, None, file, line, *ddp
    shape, dtype = tensor
    return seq, op, tuple(shape), str(dtype).replace("torch.", ""), file, line, *ddp


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


def _counted(op: str, collective):
    from torch import Tensor  # a rank has torch already (its Context needs it)
    from torch.distributed import is_initialized

    tally, clock, frame, library = TALLY, time.perf_counter, sys._getframe, _library

    def counted(*args, **kwargs):
        # Shapes and dtypes are kept as torch gives them (put in words only when asked: `_described`), and
        # never the tensors themselves, which would outlive the call.
        if tally.in_hook or tally.current is not None:  # a DDP hook's, or one torch calls inside another
            return collective(*args, **kwargs)
        if not is_initialized():
            _make_group()
        caller = frame(1)
        if library(caller.f_code.co_filename):  # FSDP2's, DTensor's, nbtrain's: the user's line that led there
            caller = _user_frame(caller)
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
    counted = {id(collective): _counted(op, collective) for op in COLLECTIVES
               if (collective := getattr(dist, op, None)) is not None}
    # Every name torch.distributed's modules hold them by: `dist.all_reduce`, distributed_c10d's own
    # (where a module imported later takes them from: DTensor's `scatter`, `broadcast`), and those
    # already imported by name. A collective torch calls inside another is counted as that one.
    for name, module in list(sys.modules.items()):
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            for attr, value in list(getattr(module, "__dict__", {}).items()):  # (an entry may be None)
                if (wrapper := counted.get(id(value))) is not None and wrapper.__wrapped__ is value:
                    setattr(module, attr, wrapper)
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
    the C++ ops themselves, reaching neither: its collectives are not counted."""
    import torch.distributed._functional_collectives as funcol

    if not getattr(funcol, "_nbtrain_counted", False):
        funcol._maybe_wrap_tensor, funcol.wait_tensor = _functional_counters(
            funcol._maybe_wrap_tensor, funcol.wait_tensor, funcol.AsyncCollectiveTensor)
        funcol._nbtrain_counted = True  # type: ignore[attr-defined]


def _functional_counters(wrap, wait, wrapper) -> tuple:
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
        user = _user_frame(caller)
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


# -- DDP's gradient all-reduce ------------------------------------------------------------------

class _Slot:
    """One DDP model's communication: the hook that all-reduces a bucket (torch's default, or the
    user's own), whether the reducer has it yet, and what the counting needs (parameters' names)."""

    __slots__ = ("hook", "state", "mine", "registered", "names", "parameter_names", "backwards")

    def __init__(self, model, hook, state) -> None:
        self.hook, self.state, self.mine, self.registered = hook, state, True, False
        self.names: dict[int, str] = {}
        # Keyed by the parameter itself (not its id: a freed id may be reused), looked up only
        # while the buckets may still be rebuilt.
        self.parameter_names = {p: (i, n) for i, (n, p) in enumerate(model.module.named_parameters())}
        self.backwards = 0


def count_ddp() -> None:
    """Count every DistributedDataParallel's bucket all-reduces in this process (once per process).

    A user's `register_comm_hook` registers the counting hook around theirs at once; otherwise the
    counting hook, around torch's default all-reduce, is registered at the model's first forward
    (a one-shot pre-hook: nothing per step). Not then under `Join(divide_by_initial_world_size=False)`:
    there DDP's own all-reduce divides by the ranks still in, which no Python hook can know, so that
    model is left as torch has it (uncounted). A hook given after the first forward fills the slot."""
    from torch import is_grad_enabled
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "_nbtrain_counted", False):
        return
    construct, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook
    pre_forward = DDP._pre_forward
    _count_backward_calls()

    def install(model, slot: _Slot) -> None:
        # The reducer's own registration, not `register_comm_hook`: the model's list of the
        # user's hooks and the hook's name in DDP's logging stay as torch keeps them.
        import torch.distributed as dist

        dist._register_comm_hook(model.reducer, slot, _bucket_reduced)
        slot.registered = True

    @functools.wraps(construct)
    def __init__(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        if getattr(self, "reducer", None) is None or getattr(self, "_use_python_reducer", False):
            return  # no C++ reducer (nothing to reduce, or compiled autograd's Python one)
        slot = self._nbtrain_slot = _Slot(self, allreduce_hook, self.process_group)

        def first_forward(model, inputs) -> None:
            handle.remove()
            if not slot.registered and getattr(model, "_divide_by_initial_world_size", True):
                install(model, slot)

        handle = self.register_forward_pre_hook(first_forward)

    @functools.wraps(register)
    def register_comm_hook(self, state, hook):
        slot = getattr(self, "_nbtrain_slot", None)
        if slot is None or (slot.registered and not slot.mine):
            return register(self, state, hook)  # torch's own (a second hook: torch's error)
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        slot.hook, slot.state, slot.mine = hook, state, False
        if not slot.registered:
            install(self, slot)

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self, comm_hook_type):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        slot = getattr(self, "_nbtrain_slot", None)
        python = {dist.BuiltinCommHookType.ALLREDUCE: allreduce_hook,
                  dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}.get(comm_hook_type)
        if slot is None or not slot.registered or not slot.mine or python is None:
            if slot is not None:
                slot.registered = True  # torch's C++ hook, as asked: this model is not counted
            return builtin(self, comm_hook_type)
        register_comm_hook(self, self.process_group, python)  # after the first forward: the same hook, in Python
        self.logger._set_comm_hook_name(str(comm_hook_type))

    @functools.wraps(pre_forward)
    def _pre_forward(self, *inputs, **kwargs):
        slot = self.__dict__.get("_nbtrain_slot")
        if slot is not None and is_grad_enabled() and not getattr(self, "_delay_all_reduce_all_params", False):
            tally = TALLY
            if self.require_backward_grad_sync:
                tally.skipped += tally.awaiting
                tally.forwards += 1
                tally.awaiting = True
                if tally.model is None or tally.model() is not self:
                    tally.model = weakref.ref(self)
            else:
                tally.unsynced += 1
        try:
            return pre_forward(self, *inputs, **kwargs)
        except RuntimeError as error:
            if slot is not None and UNREDUCED in str(error):
                _say_unreduced(self, error)
            raise

    DDP._pre_forward = _pre_forward  # type: ignore[method-assign]
    DDP.__init__ = __init__  # type: ignore[method-assign]
    DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook  # type: ignore[method-assign]
    DDP._nbtrain_counted = True  # type: ignore[attr-defined]


def _bucket_reduced(slot: _Slot, bucket):
    """DDP's hook for one bucket: noted (a collective of the rank's, with its backward() and its
    parameters), then all-reduced by the slot's hook; its future kept to tell a wait."""
    tally = TALLY
    index = bucket.index()
    if index == 0:  # DDP all-reduces its buckets in order: bucket 0 begins a backward()'s
        slot.backwards += 1
        tally.backwards += 1
        user = _user_frame(_main_frame())
        tally.backward_at = (user.f_code.co_filename, user.f_lineno) if user else None
        tally.backward_sites = _call_sites(user)
    names = slot.names.get(index) if slot.backwards > SETTLE_BACKWARDS else None
    if names is None:
        names = slot.names[index] = _bucket_names(slot, bucket)
    at = tally.backward_at
    buffer = bucket.buffer()
    tally.seq += 1
    call = (tally.seq, DDP_OP, (buffer.shape, buffer.dtype), at[0] if at else "", at[1] if at else 0,
            (slot.backwards, index, names))
    tally.recent.append(call)
    tally.progressed = time.perf_counter()
    tally.in_hook = True
    try:
        future = slot.hook(slot.state, bucket)
    finally:
        tally.in_hook = False
    tally.pending.append((call, future.done))
    return future


# torch's error at the forward after a backward() whose gradients DDP could not all-reduce.
UNREDUCED = "Expected to have finished reduction in the prior iteration"
UNUSED_FIX = ("pass find_unused_parameters=True to DistributedDataParallel, or use every parameter in every "
              "rank's forward")


def _count_backward_calls() -> None:
    """Note each backward() call (`loss.backward()` calls torch.autograd.backward): a DDP forward
    that none followed is a skipped backward(); its line names where the last one was."""
    import torch.autograd

    backward, tally, frame = torch.autograd.backward, TALLY, sys._getframe

    @functools.wraps(backward)
    def counted_backward(*args, **kwargs):
        tally.awaiting = False
        user = _user_frame(frame(1))
        tally.backward_called_at = (user.f_code.co_filename, user.f_lineno)
        return backward(*args, **kwargs)

    torch.autograd.backward = counted_backward


def _gradless(model) -> str:
    """The names of a DDP model's trained parameters that have no gradient, when some have one
    (those its forwards never used); "" when none or all have none."""
    trained = [(n, p.grad is None) for n, p in model.module.named_parameters() if p.requires_grad]
    names = [n for n, none in trained if none]
    return _names_words(names) if len(names) < len(trained) else ""


def _names_words(names: list[str]) -> str:
    more = len(names) - NAMES_SHOWN
    return ", ".join(names[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _say_unreduced(model, error: RuntimeError) -> None:
    """torch's error at the forward after a backward() some parameters got no gradient in, the
    cause and the fix said first: which parameters (torch gives their indices in the reducer's
    order), at which backward(), and that the other ranks wait in that all-reduce."""
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(error))
    names = _reducer_names(model)
    unused = [names[int(i)] for i in found[1].split() if int(i) < len(names)] if found else []
    at = TALLY.backward_called_at
    where = f" at {place_name(at[0])}:{at[1]}" if at else ""
    them = "them" if len(unused) != 1 else "it"
    said = (f"{_names_words(unused) or 'A parameter'} got no gradient in the backward(){where} (its forward did not "
            f"use {them}): DDP never all-reduced that backward()'s gradients, and ranks that used {them} wait for "
            f"them in the all-reduce — {UNUSED_FIX}.")
    error.args = (f"{said}\n(torch: {error.args[0] if error.args else ''})", *error.args[1:])


def _reducer_names(model) -> list[str]:
    """The names of a DDP model's parameters in its reducer's order (torch's indices count them):
    each module's own, trained and not ignored, the first time each is seen."""
    ignored: set[str] = getattr(model, "parameters_to_ignore", set())
    seen: set = set()
    names: list[str] = []
    for module_name, module in model.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and p not in seen:
                seen.add(p)
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


SITES = 8  # user frames around a backward() kept, outward


def _call_sites(frame) -> tuple:
    """The user's frames from `frame` outward, as (code, lasti): where each called the next."""
    sites: list[tuple] = []
    while frame is not None and len(sites) < SITES:
        if not _library(frame.f_code.co_filename):
            sites.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(sites)


def _bucket_names(slot: _Slot, bucket) -> str:
    # In the model's order (a bucket holds them in the reverse order, the order gradients come).
    return _names_words([n for _, n in sorted(slot.parameter_names.get(p, (-1, "?")) for p in bucket.parameters())])


def _main_frame():
    """The main thread's current frame: the hook's caller on a CPU backward, read from afar on a GPU's."""
    main = threading.main_thread().ident
    if threading.get_ident() == main:
        return sys._getframe(2)
    return sys._current_frames().get(main) if main is not None else None


def _waiting_in() -> tuple | None:
    """The first async collective or DDP bucket all-reduce that has not completed (read from the
    channel's thread while the main thread may append: a copy is iterated)."""
    return next((call for call, done in list(TALLY.pending) if not done()), None)


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

@functools.lru_cache(maxsize=512)
def _library(name: str) -> bool:
    return name.startswith("<frozen") or package_path(name) is not None


def _user_frame(frame):
    """The innermost frame of the user's own code (not a library's, not nbtrain's), else the innermost."""
    innermost = frame
    while frame is not None:
        if not _library(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return innermost


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
        user = _user_frame(frame)
        file, line = user.f_code.co_filename, user.f_lineno
        code = linecache.getline(file, line).split("  #")[0].strip()  # the code, without a trailing comment
    current = tally.current or _waiting_in()
    import torch.distributed as dist

    meeting = tally.rendezvous if tally.rendezvous and not dist.is_initialized() else ""
    doing = _doing(frame) if frame is not None else ""
    return protocol.Whereabouts(rank, tally.seq, current and _described(current), file, line, code,
                                time.perf_counter() - tally.progressed, meeting, tally.backwards, doing, tally.ddp())

