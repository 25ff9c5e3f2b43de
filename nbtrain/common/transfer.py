"""What crosses between the notebook and the ranks: the job out, return values back.

dill carries what plain pickle cannot: functions, lambdas and classes defined in notebook
cells, with the globals they use (recurse mode). Classes defined in the notebook come back
as the notebook's own classes, so `isinstance(result.value, Net)` holds.
"""
from __future__ import annotations

import copy
import io
import linecache
import pickle
import sys
import warnings
from typing import Any

import dill
import torch

from .errors import UnpicklableError
from .pickling import RETURN_ADVICE, ShippingPickler, dumps, explain_return, ship_bytes
from .tensor_files import RankFiles, map_storage


def to_cpu(value: Any, keep: bool = False) -> Any:
    """Tensors and modules to CPU, DDP/DataParallel unwrapped, through lists, tuples and dicts.

    `keep`: the rank goes on using what it sends (a live rank, a map's worker, a steering call), so
    a module off the CPU is copied to it rather than moved (a launch's rank ends: it moves its own)."""
    if isinstance(value, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        value = value.module
    if isinstance(value, torch.nn.Module):
        if keep and any(p.device.type != "cpu" for p in value.parameters()):
            return copy.deepcopy(value).to("cpu")
        return value.to("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) is dict:
        return {k: to_cpu(v, keep) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(v, keep) for v in value)
    return value


def _cell_sources(fn) -> dict[str, tuple]:
    # A spawned rank has no linecache for notebook cells; ship it so tracebacks show the
    # user's lines, not just "File <ipython-input-...>, line 4".
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    entry = linecache.cache.get(code.co_filename)
    return {code.co_filename: entry} if entry else {}


def pack_job(fn, args: tuple, kwargs: dict) -> bytes:
    try:
        return ship_bytes((fn, args, kwargs, _cell_sources(fn)))
    except Exception:
        pass
    # Explain each part on its own, so paths start at `train`, `args` or `kwargs`.
    name = getattr(fn, "__name__", "fn")
    what = f"the function `{getattr(fn, '__qualname__', name)}` and its arguments"
    for part, root in ((fn, name), (args, "args"), (kwargs, "kwargs")):
        dumps(part, what, root)
    return dumps((fn, args, kwargs), what)


def _publish_notebook_classes(fn, main=None, seen=None) -> None:
    # Notebook classes reach a spawned rank by value. Naming them in the rank's __main__ lets
    # its return value refer to them by name, which the notebook resolves to its own classes.
    main = main or sys.modules["__main__"]
    seen = seen if seen is not None else set()
    if id(fn) in seen:
        return
    seen.add(id(fn))
    for name, value in getattr(fn, "__globals__", {}).items():
        if getattr(value, "__module__", None) != "__main__":
            continue
        if isinstance(value, type) and not hasattr(main, name):
            setattr(main, name, value)
        elif callable(value):
            _publish_notebook_classes(value, main, seen)


def unpack_job(payload: bytes):
    fn, args, kwargs, sources = dill.loads(payload)
    linecache.cache.update(sources)
    _publish_notebook_classes(fn)
    return fn, args, kwargs


_SHARED = "nbtrain.tensor_file"  # tag of a storage that travels as a shared-memory file


class _ResultPickler(ShippingPickler):
    """dill as the job travels, with large tensor storages written to shared-memory files
    (`files`) and only their names pickled, as torch.save does with its storage records."""

    def __init__(self, file, files: RankFiles | None, **options):
        super().__init__(file, **options)
        self._files = files

    def persistent_id(self, obj):
        if self._files is None or not isinstance(obj, torch.storage.TypedStorage):
            return None
        storage = obj._untyped_storage
        path = self._files.write(storage)
        return None if path is None else (_SHARED, path, storage.nbytes(), obj.dtype)


class _ResultUnpickler(dill.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self._mapped: dict[str, torch.UntypedStorage] = {}  # views of one storage share its file

    def persistent_load(self, pid):
        tag, path, nbytes, dtype = pid
        if tag != _SHARED:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if path not in self._mapped:
            self._mapped[path] = map_storage(path, nbytes)
        return torch.storage.TypedStorage(wrap_storage=self._mapped[path], dtype=dtype, _internal=True)


def _dump_result(value, files: RankFiles | None, **options) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _ResultPickler(buffer, files, **options).dump(value)
    return buffer.getvalue()


def pack_result(value: Any, rank: int, keep: bool = False) -> bytes:
    """Rank `rank`'s return value for the notebook: tensors on CPU (`to_cpu`, `keep` as there),
    large storages through shared memory when this launch offers it (see `tensor_files`), the rest pickled."""
    value = to_cpu(value, keep)
    files = RankFiles.from_environ(rank)
    try:  # by reference first: the notebook then gets instances of its own classes back
        return _dump_result(value, files, byref=True)
    except Exception:
        pass
    try:  # by value, as the job itself travels (dill recurse)
        return _dump_result(value, files, recurse=True)
    except Exception as exc:
        if files is not None:
            files.discard()
        raise UnpicklableError(f"the return value of rank {rank}", explain_return(value), str(exc),
                               RETURN_ADVICE, returning=True) from exc


def unpack_result(payload: bytes) -> Any:
    return _ResultUnpickler(io.BytesIO(payload)).load()


PUSH_FILES = 1_000_000  # the files of a push are named as a rank this far beyond any real one


def pack_push(objects: dict, files: RankFiles | None) -> bytes:
    """Objects for live ranks, pickled as a job travels; with `files` (ranks on this machine),
    each large storage is written once to shared memory, and every rank maps that one copy
    (a 500 MB tensor went through the socket once per rank). The caller removes the files
    (`files.discard()`) once the ranks have them."""
    return _dump_result(objects, files, recurse=True)


class _PushUnpickler(_ResultUnpickler):
    def persistent_load(self, pid):
        tag, path, nbytes, dtype = pid
        if tag != _SHARED:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if path not in self._mapped:  # private (copy-on-write), and left for the other ranks to map
            self._mapped[path] = torch.UntypedStorage.from_file(path, False, nbytes)
        return torch.storage.TypedStorage(wrap_storage=self._mapped[path], dtype=dtype, _internal=True)


def unpack_push(payload: bytes) -> dict:
    return _PushUnpickler(io.BytesIO(payload)).load()


class _ExceptionPickler(dill.Pickler):
    """dill by reference, except that an exception of a user-defined class is rebuilt without
    calling its __init__: pickle's default calls `cls(*exc.args)`, which fails (or garbles the
    message) whenever __init__ takes other arguments than it passes to Exception.__init__."""

    def reducer_override(self, obj):
        cls = type(obj)
        if (isinstance(obj, BaseException) and cls.__module__ != "builtins"
                and cls.__reduce__ is BaseException.__reduce__):
            return _new_exception, (cls, obj.args), (vars(obj) or None)
        return NotImplemented


def _new_exception(cls, args):
    return cls.__new__(cls, *args)


def pack_exception(exc: BaseException) -> bytes | None:
    """A rank's exception as bytes for the notebook, classes by reference (a class defined in
    the notebook comes back as the notebook's own); None if it cannot travel. Never raises:
    it runs while a failure is being reported."""
    try:
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _ExceptionPickler(buffer, byref=True).dump(exc)
        return buffer.getvalue()
    except Exception:
        return None


def unpack_exception(payload: bytes | None) -> BaseException | None:
    """The rank's exception rebuilt in the notebook, or None where it cannot be (a class the
    notebook does not have, a __new__ that refuses)."""
    if payload is None:
        return None
    try:
        exc = dill.loads(payload)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None
