"""The rank side of `map`: take items from the notebook's work queue whenever this rank is free,
call the user's function on them, send each result back at once.

The queue has a channel of its own (`common/channel.py`: a Hub in the notebook, a Link here, the
same authkey rule), beside the run's: the run's command (a slot launch's function, or a live
rank's `call`) is this loop, and items come and results go on the side. A rank asks for the next
items only once it has sent its last result, so a fast rank takes more than a slow one.
"""
from __future__ import annotations

import queue
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass

from ..common import protocol
from ..common.channel_link import Link
from ..common.errors import UnpicklableError
from ..common.pickling import RETURN_ADVICE, explain_return
from ..common.transfer import pack_exception, to_cpu, unpack_result
from .context import context
from .trial import take_share


@dataclass
class WorkSpec:
    environ: dict[str, str]  # the queue's address and authkey, as a rank's channel variables
    fn: Callable
    bind: bool  # live ranks: `fn` travels bare and runs with this rank's namespace as its globals
    batch_size: int
    worker: int | None = None  # this worker's name on the queue; None: the rank's number
    threads: int = 0  # torch threads for this worker: its slot's share of the cores (0: as the launch set them)
    cores: tuple[int, ...] = ()  # the CPUs it runs on (its slot's, `notebook/many/slots.py`); (): any


def bind(fn, namespace: dict):
    """`fn` with the rank's namespace as its globals: it sees the model loaded there."""
    bound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__, bound.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return bound


def serve_items(spec: WorkSpec, namespace: dict | None = None) -> int:
    """Run items until the queue says done; the number of items this worker ran."""

    take_share(spec.threads, spec.cores)
    fn = bind(spec.fn, namespace if namespace is not None else {}) if spec.bind else spec.fn
    worker = spec.worker if spec.worker is not None else context().rank
    answers: queue.Queue = queue.Queue()
    link = Link(worker, spec.environ, on_command=answers.put, on_lost=lambda: answers.put(None))
    count = 0
    try:
        while True:
            link.emit(protocol.WantItems(worker, spec.batch_size))
            answer = answers.get()
            if answer is None:
                raise ConnectionError("the notebook's work queue closed its connection (the map was stopped)")
            if isinstance(answer, protocol.NoMoreItems):
                return count
            indices = [index for index, _ in answer.batch]
            try:
                items = [unpack_result(payload) for _, payload in answer.batch]  # large tensors mapped
                values = call(fn, items, spec.batch_size)
                payload = pack_values(values)
            except UnpicklableReturn as exc:  # fn ran: what it returned cannot be sent back
                link.emit(protocol.ItemsFailed(worker, indices, exc.line, str(exc), pack_exception(exc)))
                return count
            except Exception as exc:
                link.emit(protocol.ItemsFailed(worker, indices, f"{type(exc).__name__}: {exc}", own_traceback(exc),
                                               pack_exception(exc)))
                return count
            link.emit(protocol.ItemsDone(worker, indices, payload))
            count += len(indices)
    finally:
        link.close()


def call(fn, items: list, batch_size: int) -> list:
    """One result per item: `fn(item)`, or with batch_size > 1 `fn(items)`, a list of as many."""
    if batch_size == 1:
        return [fn(items[0])]
    values = fn(items)
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"with batch_size={batch_size}, fn takes a list of items and returns one result per item "
                        f"(a list, or a tensor with a row per item); it returned a {type(values).__name__}") from None
    if len(values) != len(items):
        raise ValueError(f"with batch_size={batch_size}, fn returns one result per item: it returned {len(values)} "
                         f"for {len(items)} items")
    return values


def pack_values(values: list) -> bytes:
    """Results for the notebook: tensors on CPU; classes by reference first (the notebook's own
    come back as themselves), else by value, as a launch's return value travels."""
    import dill

    values = to_cpu(values, keep=True)
    try:
        return dill.dumps(values, byref=True)
    except Exception:
        pass
    try:
        return dill.dumps(values, recurse=True)
    except Exception as exc:
        raise UnpicklableReturn(values, exc) from exc


class UnpicklableReturn(UnpicklableError):
    """What `fn` returned cannot be pickled: named as its return value, where in it and why."""

    def __init__(self, values: list, exc: BaseException):
        findings = explain_return(values[0] if len(values) == 1 else values, "the return value")
        super().__init__("fn's return value", findings, f"{type(exc).__name__}: {exc}", RETURN_ADVICE, returning=True)
        first = self.findings[0] if self.findings else None
        self.line = "its return value cannot travel back to the notebook: " + (
            f"{first.path} is a {first.type} ({first.reason})" + (f"; {first.hint}" if first.hint else "")
            if first is not None else self.detail)

    def __reduce__(self):  # travels as the plain error it is
        return (UnpicklableError, (self.what, self.findings, self.detail, self.advice, self.returning))


def own_traceback(exc: BaseException) -> str:
    """The traceback from the user's first frame on (this loop's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))
