"""Checkpoints for every strategy: torch.distributed.checkpoint (DCP), each rank its own shard.

`ctx.save_checkpoint(path, model=m, optimizer=opt, step=3)` writes a directory that any
number of ranks can load again, whatever the strategy that wrote it: models and optimizers go
through `torch.distributed.checkpoint.state_dict` (FQN keys without DDP's `module.` prefix,
FSDP shards as DTensors), so a 2-rank fsdp checkpoint loads into one plain module and a
single-device one into fsdp. Plain state (numbers, tensors, anything with
`state_dict`/`load_state_dict`, such as an LR scheduler) travels as DCP stores it; plain
values are the same on every rank (a step, an epoch), and one rank's copy is kept.

A save is written beside `path` (`path.partial`) and swapped in when complete, so `path` always
holds the last whole checkpoint: a run killed while saving resumes from the one before, and one
killed between the two renames of the swap leaves it as `path.old`, which `load` then reads
(saying so). A save that fails removes what it wrote, and says why in one line
(`CheckpointError`), not at the end of DCP's per-rank tracebacks.
"""
from __future__ import annotations

import contextlib
import errno as errnos
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..common.errors import NbtrainError
from ..common.private import DIR_MODE, FILE_MODE, make_parents
from ..common.words import ranks_words

METADATA = ".metadata"  # DCP's index file: its presence marks a checkpoint directory
# DCP's words for a checkpoint that is whole but holds other shapes or names than the objects given
MISMATCH = ("Size mismatch", "Missing key", "Unexpected key")
FULL_BELOW = 4 << 20  # bytes free: a write that failed on a file system this full ran out of space

log = logging.getLogger(__name__)


class CheckpointError(NbtrainError, OSError):
    """A checkpoint could not be saved or loaded. The message is the cause in one line, with the
    path and the ranks it happened on; `causes` has each failed rank's own error, one line each.
    `errno` is set where the cause is the operating system's (ENOSPC, EROFS, ENOTDIR, ...)."""

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None,
                 causes: dict[int, str] | None = None):
        super().__init__(message)
        self.errno, self.filename, self.causes = errno, filename, dict(causes or {})

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0], self.errno, self.filename, self.causes))


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # DataParallel is not known to DCP's state_dict helpers; DDP's prefix they strip themselves.
    return module.module if isinstance(module, torch.nn.DataParallel) else module


class _ModelState:
    """A model as DCP's Stateful: sharded or plain, keyed by fully qualified names."""

    def __init__(self, model):
        self.model = _unwrap(model)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class _OptimizerState:
    """An optimizer as DCP's Stateful, keyed by its model's parameter names (not positions),
    which is what lets it load onto another sharding."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = _unwrap(model), optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def _stateful(objects: dict, verb: str) -> dict:
    """The objects as DCP's state dict; optimizers paired with the model holding their parameters."""
    if not objects:
        raise ValueError(f"ctx.{verb}_checkpoint(path, ...) needs what to {verb} by name, e.g. "
                         f"ctx.{verb}_checkpoint(path, model=model, optimizer=optimizer, step=step).")
    for name, obj in objects.items():
        if any(cls.__name__ == "DeepSpeedEngine" for cls in type(obj).__mro__):
            raise ValueError(f"{name}=: a DeepSpeed engine keeps its ZeRO partitions in DeepSpeed's own checkpoint "
                             f"format: use {name}.save_checkpoint(directory) and {name}.load_checkpoint(directory).")
    models = {name: obj for name, obj in objects.items() if isinstance(obj, torch.nn.Module)}
    state: dict[str, object] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            state[name] = _ModelState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            state[name] = _OptimizerState(_owner(name, obj, models, verb), obj)
        else:
            state[name] = obj
    return state


def _owner(name: str, optimizer, models: dict, verb: str) -> torch.nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models.values():
        if any(id(p) in params for p in model.parameters()):
            return model
    given = f" (models given: {', '.join(models)})" if models else ""
    raise ValueError(f"{name}=: the optimizer's parameters belong to no model given to {verb}_checkpoint{given}; "
                     f"give its model too, e.g. ctx.{verb}_checkpoint(path, model=model, {name}={name}).")


def _group(ctx):
    """The process group to use, or None for a single process (DCP then runs without one)."""
    import torch.distributed as dist

    if ctx.is_distributed:
        ctx._ensure_group()
    return dist.group.WORLD if dist.is_initialized() else None


def _barrier(group) -> None:
    import torch.distributed as dist

    if group is not None:
        dist.barrier(group)


@contextlib.contextmanager
def _single_process_is_meant():
    # DCP warns on every call without a process group; one process is what a single-device run is.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def is_checkpoint(path) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def _checked_path(path, verb: str) -> str:
    """`path` as an absolute str, once it names a directory a checkpoint may be in. A save
    replaces its directory whole: '' (or '.') would be the working directory itself."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{verb}_checkpoint(path={path!r}): give the checkpoint's directory as a str or "
                        "pathlib.Path, e.g. 'checkpoints/last'.")
    given = os.fspath(path)
    if not given.strip():
        raise ValueError(f"{verb}_checkpoint(path={given!r}): give the checkpoint's directory, e.g. "
                         "'checkpoints/last' (a save replaces that directory whole).")
    path = os.path.abspath(given)
    if verb == "save":
        here = os.getcwd()
        if os.path.commonpath([here, path]) == path:
            where = "the working directory" if path == here else f"a directory above the working directory ({here})"
            raise ValueError(f"save_checkpoint(path={given!r}) is {where}: a save replaces its directory whole. Give "
                             "a directory of its own, e.g. 'checkpoints/last'.")
    return path


def save(ctx, path, objects: dict) -> None:
    import torch.distributed.checkpoint as dcp

    path = _checked_path(path, "save")
    if os.path.exists(path) and not is_checkpoint(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"save_checkpoint: {path} exists and is not a checkpoint; nbtrain replaces only "
                              "checkpoints it wrote. Give a new path, or remove it.")
    state = _stateful(objects, "save")
    group = _group(ctx)
    partial = path + ".partial"
    if ctx.is_global_zero and os.path.exists(partial):  # left by a run killed while saving
        shutil.rmtree(partial, ignore_errors=True)
    _barrier(group)
    try:
        make_parents(Path(partial))  # DCP would make them with the umask's mode (0777 under umask 000)
        os.makedirs(partial, DIR_MODE, exist_ok=True)
        with _single_process_is_meant():
            dcp.save(state, checkpoint_id=partial, storage_writer=_writer(partial), process_group=group,
                     no_dist=group is None)
    except _failures() as exc:  # every rank hears of every rank's failure: each cleans up and says it
        error = _explain(exc, "save", path, partial, ctx.rank)
        shutil.rmtree(partial, ignore_errors=True)  # a partial save only fills the disk
        raise error from None
    if ctx.is_global_zero:  # dcp.save returns on rank 0 once every rank's shard is written
        old = path + ".old"
        try:
            _private_files(partial)
            if os.path.exists(path):
                os.replace(path, old)
            os.replace(partial, path)
        except OSError as exc:
            raise _explain(exc, "save", path, partial, ctx.rank) from None
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)  # nobody reads `path` before it is whole


def load(ctx, path, objects: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    path = _checked_path(path, "load")
    where = path
    if not is_checkpoint(path):
        if os.path.exists(path) or not is_checkpoint(path + ".old"):
            raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path} (a directory written by "
                                    "ctx.save_checkpoint). To resume only when there is one: "
                                    "`if os.path.exists(path): ctx.load_checkpoint(path, ...)`.")
        # A save stopped between its two renames: the checkpoint before it is whole, beside `path`.
        where = path + ".old"
        if ctx.is_global_zero:
            log.warning("load_checkpoint: %s is missing, but %s holds the checkpoint saved before it (a save was "
                        "stopped while swapping in a new one): loading that.", path, where)
    state = _stateful(objects, "load")
    held = _names(where)
    missing = [name for name in objects if held is not None and name not in held]
    if missing:
        raise CheckpointError(f"load_checkpoint: {where} has no {', '.join(map(repr, missing))}; it holds "
                              f"{', '.join(sorted(held or ()))}.", filename=where)
    group = _group(ctx)
    try:
        with _single_process_is_meant():
            dcp.load(state, checkpoint_id=where, process_group=group, no_dist=group is None)
    except _failures() as exc:
        raise _explain(exc, "load", where, where, ctx.rank) from None
    return {name: objects[name] if isinstance(state[name], (_ModelState, _OptimizerState)) else state[name]
            for name in objects}


def _names(path: str) -> set[str] | None:
    """The names a checkpoint holds (`model`, `optimizer`, `step`), from DCP's index; None when it
    cannot be read (the load then says it is damaged)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:
        return None
    return {key.split(".", 1)[0] for key in keys}


def _failures() -> tuple:
    # DCP's CheckpointException is a BaseException. Imported here, not at the top: DCP pulls in
    # DTensor and sympy (0.4 s), which a run that saves no checkpoint never needs.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _explain(exc: BaseException, verb: str, path: str, written: str, rank: int) -> CheckpointError:
    """The cause of a failed save or load in one line: `save_checkpoint: no space left on device
    writing PATH (rank 1)`. DCP gathers every rank's error; the lowest rank's leads."""
    failures = {r: error for r, (error, _) in getattr(exc, "failures", {}).items()} or {rank: exc}
    ranks = sorted(failures)
    first = failures[ranks[0]]
    who = ranks_words(ranks)
    doing = "writing" if verb == "save" else "reading"
    code = first.errno if isinstance(first, OSError) and first.strerror else None
    if code is None and verb == "save" and _nearly_full(written):  # torch's zip writer loses ENOSPC
        code = errnos.ENOSPC
    if code is not None:
        message = f"{verb}_checkpoint: {_lower(os.strerror(code))} {doing} {path} ({who})"
    elif verb == "load" and any(words in str(first) for words in MISMATCH):
        message = f"load_checkpoint: {path} does not fit what was given ({who}): {_brief(first)}"
    elif verb == "load":
        message = (f"load_checkpoint: {path} cannot be read ({who}): it is damaged, or was not written by "
                   f"save_checkpoint — {_brief(first)}")
    else:
        message = f"save_checkpoint: writing {path} failed ({who}): {_brief(first)}"
    return CheckpointError(message, code, path, {r: _brief(e) for r, e in failures.items()})


def _private_files(directory: str) -> None:
    """What DCP wrote under `directory` (with the umask's modes) made 0600 in 0700 folders."""
    for folder, _, files in os.walk(directory):
        os.chmod(folder, DIR_MODE)
        for name in files:
            os.chmod(os.path.join(folder, name), FILE_MODE)


def _writer(partial: str):
    """DCP's file writer, saying ENOSPC where torch's zip writer loses it ("file write failed"):
    judged by the rank that failed, while its disk is still full. The other ranks hear of the
    failure only after DCP gathers it, by when a rank may have removed the partial save."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            with _full_disk_named(partial):
                return super().write_data(plan, planner)

        def finish(self, metadata, results):
            with _full_disk_named(partial):
                return super().finish(metadata, results)

    return Writer(partial)


@contextlib.contextmanager
def _full_disk_named(path: str):
    try:
        yield
    except Exception as exc:
        if not (isinstance(exc, OSError) and exc.strerror) and _nearly_full(path):
            raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC), path) from exc
        raise


def _nearly_full(path: str) -> bool:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path or "/")
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < FULL_BELOW


def _brief(error: BaseException) -> str:
    """An error's type and first sentence."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text.split(". ")[0]
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]
