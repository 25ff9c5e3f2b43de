"""DDP's gradient all-reduce, counted for the doctor, and DDP's mistakes said in words.

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
"""
from __future__ import annotations

import functools
import re
import sys
import threading
import time
import weakref

from ..common.tracebacks import place_name
from .tally import TALLY, library, names_words, user_frame

DDP_OP = "DDP's gradient all-reduce"  # a bucket's all-reduce, as a counted call's op
SETTLE_BACKWARDS = 2  # DDP rebuilds its buckets once, after the first backward(): names read until then


class Slot:
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

    def install(model, slot: Slot) -> None:
        # The reducer's own registration, not `register_comm_hook`: the model's list of the
        # user's hooks and the hook's name in DDP's logging stay as torch keeps them.
        import torch.distributed as dist

        dist._register_comm_hook(model.reducer, slot, bucket_reduced)
        slot.registered = True

    @functools.wraps(construct)
    def __init__(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        if getattr(self, "reducer", None) is None or getattr(self, "_use_python_reducer", False):
            return  # no C++ reducer (nothing to reduce, or compiled autograd's Python one)
        slot = self._nbtrain_slot = Slot(self, allreduce_hook, self.process_group)

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


def bucket_reduced(slot: Slot, bucket):
    """DDP's hook for one bucket: noted (a collective of the rank's, with its backward() and its
    parameters), then all-reduced by the slot's hook; its future kept to tell a wait."""
    tally = TALLY
    index = bucket.index()
    if index == 0:  # DDP all-reduces its buckets in order: bucket 0 begins a backward()'s
        slot.backwards += 1
        tally.backwards += 1
        user = user_frame(_main_frame())
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
        user = user_frame(frame(1))
        tally.backward_called_at = (user.f_code.co_filename, user.f_lineno)
        return backward(*args, **kwargs)

    torch.autograd.backward = counted_backward


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
    said = (f"{names_words(unused) or 'A parameter'} got no gradient in the backward(){where} (its forward did not "
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
        if not library(frame.f_code.co_filename):
            sites.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(sites)


def _bucket_names(slot: Slot, bucket) -> str:
    # In the model's order (a bucket holds them in the reverse order, the order gradients come).
    return names_words([n for _, n in sorted(slot.parameter_names.get(p, (-1, "?")) for p in bucket.parameters())])


def _main_frame():
    """The main thread's current frame: the hook's caller on a CPU backward, read from afar on a GPU's."""
    main = threading.main_thread().ident
    if threading.get_ident() == main:
        return sys._getframe(2)
    return sys._current_frames().get(main) if main is not None else None
