"""A rank looks like a torchrun worker to the libraries inside it, whatever started it.

Lightning, Accelerate and Transformers each decide by their own rules whether they were launched
already (torchrun's environment: the placement sets it, `placements.base.rank_environ`) or must
start processes themselves. A rank forked from a Jupyter kernel also inherits what would mislead
them, undone here: IPython's prompt (`sys.ps1`), from which Lightning concludes "interactive" and
refuses `strategy="ddp"` or turns `"auto"` into a nested fork; Lightning's copies of that verdict,
computed in the kernel at import; an Accelerate state the kernel created.

Where user code would still start ranks of its own from inside a rank (`torch.multiprocessing
.spawn`, Accelerate's `notebook_launcher`, Lightning's `ddp_notebook` / `ddp_spawn`), one error
names the call instead of a nested launch. And code that sets up its own process group (the
PyTorch DDP tutorial's `setup()`) works, however it imported the functions: a call that matches
the group the rank already has is a no-op, under torchrun an address the user chose is honoured
instead of waiting on torchrun's agent store at another port, and a destroy waits for the end of
the command.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import sys
import traceback
import types

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing

from ..common.errors import NbtrainError
from ..common.import_hooks import when_imported

log = logging.getLogger(__name__)

# Lightning computes "interactive" once (lightning_fabric.utilities.imports._IS_INTERACTIVE) and
# modules copy it with `from ... import`: each copy already imported must be corrected.
_INTERACTIVE_COPIES = tuple(
    f"{package}.{module}"
    for package, modules in (
        ("lightning_fabric", ("utilities.imports", "connector", "strategies.launchers.multiprocessing")),
        ("lightning.fabric", ("utilities.imports", "connector", "strategies.launchers.multiprocessing")),
        ("pytorch_lightning", ("trainer.connectors.accelerator_connector", "callbacks.progress.rich_progress")),
        ("lightning.pytorch", ("trainer.connectors.accelerator_connector", "callbacks.progress.rich_progress")))
    for module in modules)
# Whose frames tell which library asked for the nested launch, for the error's advice: the first
# that matches (a Trainer's launch runs through Fabric's code too, so the Trainer comes first).
_TRAINER = ("a Lightning Trainer with strategy 'ddp_notebook', 'ddp_fork' or 'ddp_spawn'",
            "give the Trainer strategy='ddp' (or 'auto') and devices=LOCAL_WORLD_SIZE: it then joins nbtrain's ranks")
_FABRIC = ("Lightning Fabric with strategy 'ddp_notebook', 'ddp_fork' or 'ddp_spawn'",
           "give Fabric strategy='ddp' (or 'auto') and devices=LOCAL_WORLD_SIZE, and call fabric.launch() with no "
           "function (or call your function directly): it then joins nbtrain's ranks")
_LAUNCHERS = (
    ("pytorch_lightning", *_TRAINER),
    ("lightning.pytorch", *_TRAINER),
    ("lightning_fabric", *_FABRIC),
    ("lightning.fabric", *_FABRIC),
    ("accelerate", "accelerate's notebook_launcher",
     "call the training function directly (Accelerator() joins nbtrain's ranks), or call "
     "notebook_launcher(fn, args, num_processes=N) (from nbtrain.notebook.dropins) from the notebook instead"),
)


class NestedLaunchError(NbtrainError, RuntimeError):
    """User code inside a rank tried to start ranks of its own."""


def become_torchrun_worker() -> None:
    """Called once in every rank before the user's code runs."""
    os.environ.setdefault("NBTRAIN_MASTER", f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}")
    # A barrier at the end of init_process_group: no rank leaves the set-up until every rank's gloo
    # mesh is connected. Without it a rank whose code returns right after (`Accelerator()` and
    # return) tore its group down while a peer was still connecting to it, which failed that peer
    # with "Gloo connectFullMesh failed ... Connection closed by peer" (1 launch in 120 on the
    # template, 1 in 200 forked, here). torch's own (TORCH_DIST_INIT_BARRIER, off by default) waits
    # on the store, which a FileStore polls every 10 ms; a gloo group meets over its own sockets
    # instead (`init_process_group` below). The user's own setting wins.
    _OUR_INIT_BARRIER[0] = "TORCH_DIST_INIT_BARRIER" not in os.environ
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    _forget_the_kernel()
    _refuse_nested_launches()
    _adopt_process_group_calls()


def _forget_the_kernel() -> None:
    for prompt in ("ps1", "ps2", "ps3"):  # IPython's: their presence means "interactive" to Lightning
        sys.__dict__.pop(prompt, None)
    for name in _INTERACTIVE_COPIES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_IS_INTERACTIVE", False):
            module._IS_INTERACTIVE = False  # type: ignore[attr-defined]  # checked just above (getattr)
    state = sys.modules.get("accelerate.state")
    if state is not None:  # the kernel made an Accelerator before the fork: its singleton is not this rank's
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _refuse_nested_launches() -> None:
    start = torch.multiprocessing.start_processes
    if getattr(start, "_nbtrain_guard", False):
        return

    @functools.wraps(start)
    def start_processes(*args, **kwargs):
        raise _nested("torch.multiprocessing.spawn / start_processes")

    start_processes._nbtrain_guard = True  # type: ignore[attr-defined]  # a mark on the function, which mypy does not model
    # torch.multiprocessing.spawn() calls its module's start_processes: replace both names (the
    # module by its sys.modules name: `torch.multiprocessing.spawn` the attribute is the function).
    torch.multiprocessing.start_processes = start_processes
    sys.modules["torch.multiprocessing.spawn"].start_processes = start_processes  # type: ignore[attr-defined]  # a module
    # Accelerate's notebook_launcher starts torchrun's agent first (which binds its fixed port):
    # refuse there, before anything binds.
    when_imported("torch.distributed.launcher.api", _refuse_elastic_launch)


def _refuse_elastic_launch(api) -> None:
    def elastic_launch(*args, **kwargs):
        raise _nested("torch.distributed.launcher.api.elastic_launch")

    class LaunchConfig(api.LaunchConfig):
        # Refused as it is built: torch's makes a torchelastic_* log directory then, before the launch.
        def __post_init__(self):
            raise _nested("torch.distributed.launcher.api.elastic_launch")

    api.elastic_launch, api.LaunchConfig = elastic_launch, dataclasses.dataclass(LaunchConfig)


def _nested(call: str) -> NestedLaunchError:
    what, advice = call, ("call the function directly here, or spawn(fn, args=..., nprocs=N) (from "
                          "nbtrain.notebook.dropins) from the notebook instead of mp.spawn")
    modules = {frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_stack(None)}
    for package, name, instead in _LAUNCHERS:
        if any(m == package or m.startswith(package + ".") for m in modules):
            what, advice = name, instead
            break
    world, rank = os.environ.get("WORLD_SIZE", "?"), os.environ.get("RANK", "?")
    return NestedLaunchError(
        f"{what} was called inside an nbtrain rank: it would start more processes from each of the {world} ranks "
        f"nbtrain already started. This process is already rank {rank} of {world}; {advice}.")


_DESTROY_ASKED = [False]  # the user's destroy_process_group(), carried out when the command ends
_OUR_INIT_BARRIER = [False]  # nbtrain, not the user, set TORCH_DIST_INIT_BARRIER (become_torchrun_worker)


def _adopt_process_group_calls() -> None:
    if hasattr(destroy_asked_group, "destroy"):
        return

    def init_process_group(backend=None, *args, **kwargs):
        if _DESTROY_ASKED[0]:  # destroyed, then set up again in the same command: do both now
            destroy_asked_group()
        if dist.is_initialized():
            _check_same_group(backend, kwargs.get("world_size", -1), kwargs.get("rank", -1))
            return None
        _honour_a_chosen_address()
        if not (_OUR_INIT_BARRIER[0] and str(backend).lower() == "gloo"):
            return real_init(backend, *args, **kwargs)
        os.environ["TORCH_DIST_INIT_BARRIER"] = "0"  # read by torch's call: its store barrier is replaced below
        try:
            real_init(backend, *args, **kwargs)
        finally:
            os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
        # Over the mesh just connected (~0.1 ms where the store's took 4-10 ms), and as part of the
        # set-up: c10d's own, not the doctor's counted `dist.barrier` (a user's collective).
        getattr(c10d.barrier, "__wrapped__", c10d.barrier)()
        return None

    # The DDP tutorial's cleanup() destroys the group while its DDP model is still alive in the
    # caller's frame; freeing the model after that hangs the rank in PyTorch's teardown about one
    # time in ten. Destroying the default group once the command is over (its objects freed)
    # keeps the user's order of calls and loses the hang.
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            _DESTROY_ASKED[0] = dist.is_initialized()
            return None
        return real_destroy(group)

    real_init = _take_over(c10d.init_process_group, init_process_group)
    real_destroy = _take_over(c10d.destroy_process_group, destroy_process_group)
    destroy_asked_group.destroy = real_destroy  # type: ignore[attr-defined]  # a mark on the function, which mypy does not model


def _take_over(torchs, ours):
    """Make torch's function object itself run `ours`; return a copy that runs torch's code.

    Code holds torch's functions under many names: `dist.init_process_group`, a library's
    reference, and `from torch.distributed import destroy_process_group` in the notebook or a
    user's module, which a rank forked from the kernel inherits bound before any patch (a template
    or spawned rank imports it afresh). Changing the one function object they all name makes one
    rule for every placement, at no cost per name. torch's `init_process_group` is a decorator's
    wrapper that calls what its one cell holds; `destroy_process_group` is a plain function, whose
    code is swapped for a call to ours. Anything else (another torch) has its module names replaced."""
    cells = tuple(types.CellType(cell.cell_contents) for cell in torchs.__closure__ or ())
    real = types.FunctionType(torchs.__code__, torchs.__globals__, torchs.__name__, torchs.__defaults__, cells or None)
    real.__kwdefaults__, real.__qualname__ = torchs.__kwdefaults__, torchs.__qualname__
    if torchs.__code__.co_freevars == ("func",):
        torchs.__closure__[0].cell_contents = ours
    elif not torchs.__code__.co_freevars:
        handoff = f"_nbtrain_{torchs.__name__}"
        namespace: dict = {}
        exec(f"def trampoline(*args, **kwargs):\n    return {handoff}(*args, **kwargs)", namespace)
        torchs.__globals__[handoff] = ours
        torchs.__code__, torchs.__defaults__, torchs.__kwdefaults__ = namespace["trampoline"].__code__, None, None
        torchs.__wrapped__ = real  # inspect.signature shows torch's parameters
    else:
        functools.update_wrapper(ours, real)
        setattr(c10d, torchs.__name__, ours)
        setattr(dist, torchs.__name__, ours)
    return real


def destroy_asked_group() -> None:
    """Carry out a destroy_process_group() the user's code asked for during the command."""
    if _DESTROY_ASKED[0]:
        # The command's models, and their communication hooks, go first. A collection walks only
        # what the rank made: what it inherited was frozen as it started (loop.serve).
        gc.collect()
        destroy_group_now()


def destroy_group_now() -> None:
    """Destroy the default group at once (nbtrain's own teardown), whether or not it is adopted."""
    _DESTROY_ASKED[0] = False
    if dist.is_initialized():
        getattr(destroy_asked_group, "destroy", c10d.destroy_process_group)()


def _check_same_group(backend, world_size: int, rank: int) -> None:
    """A call matching the group this rank already has is a no-op; any other is an error that
    says what differs (a second default group cannot exist)."""
    have = dist.get_backend()
    differs = []
    if world_size not in (-1, None) and int(world_size) != dist.get_world_size():
        differs.append(f"world_size={world_size} (the group has {dist.get_world_size()})")
    if rank not in (-1, None) and int(rank) != dist.get_rank():
        differs.append(f"rank={rank} (this rank is {dist.get_rank()})")
    if backend is not None and str(backend).lower() not in str(have).lower():
        differs.append(f"backend={backend!r} (the group's is {have!r})")
    if differs:
        raise RuntimeError(
            f"init_process_group({', '.join(differs)}): this rank already belongs to nbtrain's process group of "
            f"{dist.get_world_size()} ranks ({have}). Call it with the rank's own values (RANK, WORLD_SIZE from "
            f"the environment), or not at all: torch.distributed works as it is.")
    log.debug("init_process_group: this rank's group already exists; the call is a no-op")


def _honour_a_chosen_address() -> None:
    """Under torchrun, ranks look for the store torchrun's agent hosts at the address torchrun
    gave them. Code that sets MASTER_ADDR/MASTER_PORT itself would wait there forever: give it
    the store it asked for (rank 0 hosts it at that address), as a plain launch would."""
    given = os.environ.get("NBTRAIN_MASTER", "")
    chosen = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and given and chosen != given:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        log.info("init_process_group: MASTER_ADDR:MASTER_PORT set to %s by the code (torchrun's is %s); rank 0 "
                 "hosts the store there", chosen, given)


class SpawnCall:
    """`fn(RANK, *args)` on each rank: `torch.multiprocessing.spawn`'s calling convention
    (`nbtrain.spawn`). A class of nbtrain's, so it travels by reference with `fn` inside."""

    def __init__(self, fn, args: tuple, environ: dict[str, str] | None = None):
        self.fn, self.args, self.environ = fn, args, dict(environ or {})
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self):
        os.environ.update(self.environ)
        return self.fn(int(os.environ["RANK"]), *self.args)


class LauncherCall(SpawnCall):
    """`fn(*args)` with variables set in the rank first (`nbtrain.notebook_launcher`)."""

    def __call__(self):
        os.environ.update(self.environ)
        return self.fn(*self.args)
