"""What crosses between the notebook and the ranks: the job out, return values back.

dill carries what plain pickle cannot: functions, lambdas and classes defined in notebook
cells, with the globals they use (recurse mode). Classes defined in the notebook come back
as the notebook's own classes, so `isinstance(result.value, Net)` holds.
"""
from __future__ import annotations

import linecache
from typing import Any

import dill
import torch

from .errors import UnpicklableError


def to_cpu(value: Any) -> Any:
    """Tensors and modules to CPU, DDP/DataParallel unwrapped, through lists, tuples and dicts."""
    if isinstance(value, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        value = value.module
    if isinstance(value, torch.nn.Module):
        return value.to("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    return value


def _cell_sources(fn) -> dict[str, tuple]:
    # A spawned rank has no linecache for notebook cells; ship it so tracebacks show the
    # user's lines, not just "File <ipython-input-...>, line 4".
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    entry = linecache.cache.get(code.co_filename)
    return {code.co_filename: entry} if entry else {}


def _dumps(obj, what: str) -> bytes:
    from .pickling import dumps

    return dumps(obj, what)


def pack_job(fn, args: tuple, kwargs: dict) -> bytes:
    name = getattr(fn, "__qualname__", repr(fn))
    job = (fn, args, kwargs, _cell_sources(fn))
    return _dumps(job, f"the function `{name}` and its arguments")


def unpack_job(payload: bytes):
    fn, args, kwargs, sources = dill.loads(payload)
    linecache.cache.update(sources)
    return fn, args, kwargs


def pack_result(value: Any, rank: int) -> bytes:
    return _dumps(to_cpu(value), f"the return value of rank {rank}")


def unpack_result(payload: bytes) -> Any:
    return dill.loads(payload)
