"""Whether the kernel imports torch._dynamo before forking ranks, and the import itself.

Building an optimizer, DDP or torch.compile in a rank imports torch._dynamo (~800 modules, ~1-2
s): ranks forked from a kernel that holds it share it. The kernel imports it only for ranks that
need it: a launch whose code names what imports it, or any fork once a rank of this kernel has
imported it (the rank sets a byte in a page shared with the kernel: `rank/forked.py`). Live
ranks start without it.
"""
from __future__ import annotations

import functools
import itertools
import mmap
import sys
import types

from .base import Job

_warm = False
# Set to 1 by a forked rank that imported torch._dynamo (`rank/forked.py`'s `DynamoNoticed`): an anonymous shared
# page, the same one in the kernel and in every fork of it.
_ranks_imported_dynamo = mmap.mmap(-1, 1)
# Names whose use in a rank imports torch._dynamo (~800 modules, sympy's among them; ~1-2 s): an
# optimizer (its methods are wrapped by `torch._disable_dynamo`, so constructing one imports it),
# DDP (its constructor reads dynamo's config), torch.compile, activation checkpointing, and the
# trainers and wrappers that build them. torch.optim's own names are added where it is imported.
_DYNAMO_USERS = frozenset({"optim", "setup", "prepare", "DistributedDataParallel", "DDP", "FullyShardedDataParallel",
                           "FSDP", "fully_shard", "compile", "checkpoint", "Trainer", "Fabric", "Accelerator",
                           "initialize"})
_LIBRARIES = frozenset({"nbtrain", "torch", *sys.stdlib_module_names})  # their code is read for no one


def warm_kernel() -> None:
    """Import once, in the kernel, what every rank would otherwise import after the fork.

    Building DistributedDataParallel or an optimizer lazily imports ~800 modules (~1 s); forked
    ranks share what the kernel already holds. Synchronously: a fork during an import deadlocks
    the child.
    """
    global _warm
    if not _warm:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel.distributed  # noqa: F401

        _warm = True


def wants_warm_kernel(job: Job) -> bool:
    """Whether `warm_kernel` runs before forking `job`'s ranks: when a rank of this kernel has
    needed it already, or when the launch's code names what needs it (or the kernel has it: then
    it costs nothing). Live ranks start without it: their commands come later, and a start that
    never trains does not pay ~1 s for it."""
    if _warm or "torch._dynamo" in sys.modules or _ranks_imported_dynamo[0]:
        return True
    if job.live:
        return False
    try:
        return names_dynamo_users(job.fn, job.args, job.kwargs)
    except Exception:  # an object that fails when looked at (a proxy's __class__): warm, as before
        return True


def names_dynamo_users(*roots, limit: int = 500) -> bool:
    """Whether code reachable from `roots` names something that imports torch._dynamo in a rank
    (`_DYNAMO_USERS`): the names of functions, and what they reach through their closures,
    defaults and the globals they name, partials, methods, classes and the fields of objects
    (nbtrain's own wrappers hold the user's function so). Not the code of torch, nbtrain or the
    standard library. True too when there is more than `limit` objects to read: warm, to be safe.
    A miss costs one launch: its ranks import it each, and say so (`_ranks_imported_dynamo`)."""
    optim = sys.modules.get("torch.optim")
    users = _DYNAMO_USERS.union(getattr(optim, "__all__", ()))
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if isinstance(obj, (str, bytes, int, float, types.ModuleType)) or obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return True
        if isinstance(obj, types.FunctionType):
            if _library(obj):
                todo += [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
                continue
            names = {name for code in _codes(obj.__code__) for name in code.co_names}
            if names & users:
                return True
            todo += [obj.__globals__[name] for name in names if name in obj.__globals__]
            todo += [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
            todo += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        elif isinstance(obj, types.MethodType):
            todo += [obj.__func__, obj.__self__]
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (tuple, list, set, frozenset)):
            todo += itertools.islice(obj, 100)
        elif isinstance(obj, dict):
            todo += itertools.islice(obj.values(), 100)
        elif isinstance(obj, type):  # its methods, and those of its bases that are not a library's
            todo += [getattr(value, "__func__", value) for klass in obj.__mro__ if not _library(klass)
                     for value in vars(klass).values() if isinstance(value, (types.FunctionType, staticmethod,
                                                                             classmethod))]
        else:
            try:
                fields = vars(obj)
            except Exception:  # no __dict__ (a number array), or an odd object's own error: nothing to read
                continue
            todo += [type(obj), *itertools.islice(fields.values(), 100)]
    return False


def _library(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").partition(".")[0] in _LIBRARIES


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def dynamo_page() -> mmap.mmap | None:
    """The page a forked rank marks when it imports torch._dynamo; None once the kernel holds it."""
    return None if _warm else _ranks_imported_dynamo
