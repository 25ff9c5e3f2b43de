"""The rank side of a sweep's trial: its share of the cores, and Optuna's trial object.

A trial runs as a launch of `run_trial(spec)`. It first takes the slot's share of the machine
(torch's threads, and the slot's cores where the slots do not outnumber them), so that trials
side by side do not fight over the cores. Then it calls the user's function: `fn(**params)`, or
`fn(trial)` with a `RemoteTrial`, which looks like the `optuna.trial.Trial` it stands for: each
`suggest_*`, `report`, `should_prune`, `set_user_attr`, `params` is asked of the study in the
notebook over the sweep's own channel (`common/channel.py`; the notebook's side is
`notebook/many/sweep_trials.py`), so define-by-run spaces, conditional parameters and pruning work as
Optuna's own `study.optimize` runs them. A trial that raises `optuna.TrialPruned` returns `PRUNED`.
"""
from __future__ import annotations

import os
import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..common import protocol
from ..common.channel_link import Link
from ..common.transfer import unpack_exception
from .context import context

ASK_SECONDS = 600.0  # a sampler may think a while (a GP over many trials); a notebook that never answers is gone
NAME_STRIDE = 1 << 16  # a rank's name on the sweep's channel: its trial's number * NAME_STRIDE + its rank


@dataclass
class TrialSpec:
    fn: Callable | None  # None: the function this process kept under `sweep` (sent with its first trial)
    number: int  # the trial's number in its study
    params: dict | None  # fn(**params); None: fn(trial), the trial asked of `environ`'s channel
    environ: dict[str, str]  # the sweep's trial channel, as a rank's channel variables
    threads: int = 0  # torch threads per rank (0: as the launch set them)
    cores: tuple[int, ...] = ()  # the CPUs this trial's processes run on (): any
    warm: bool = False  # a call on the slot's live rank, which ran trials before (`notebook/many/sweep_workers.py`)
    sweep: str = ""  # a warm rank's sweep: its function is kept here after the first trial brought it


_KEPT: dict[str, Callable] = {}  # a warm rank's sweep's function, unpickled once (its globals, a dataset, with it)


class _Pruned:
    """What a trial returns when its code raised optuna.TrialPruned: the notebook tells PRUNED."""

    def __repr__(self) -> str:
        return "PRUNED"

    def __reduce__(self):
        return "PRUNED"  # one object, in the rank and in the notebook


PRUNED = _Pruned()


class _Unknown:
    """What a warm rank returns for a trial sent without its function when it keeps none (a fresh
    process after a restart): the notebook sends the trial again, with it."""

    def __repr__(self) -> str:
        return "FUNCTION_WANTED"

    def __reduce__(self):
        return "FUNCTION_WANTED"


FUNCTION_WANTED = _Unknown()


def take_share(threads: int, cores: tuple[int, ...]) -> None:
    """This process's share of the machine: its cores first (the threads torch starts later run
    there), then torch's intra-op threads, unless the user set OMP_NUM_THREADS."""
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError:  # cores taken away (a cgroup's cpuset): the threads still limit it
            pass
    if threads and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads)


def run_trial(spec: TrialSpec):
    """One trial on this rank: what `fn` returns (PRUNED when it raised optuna.TrialPruned)."""
    fn = kept_function(spec)
    if fn is None:
        return FUNCTION_WANTED
    take_share(spec.threads, spec.cores)
    if spec.warm:
        fresh_run()
    try:
        if spec.params is not None:
            return fn(**spec.params)
        trial = RemoteTrial(spec.number, spec.environ, context().rank)
        try:
            return fn(trial)
        except Exception as exc:
            if type(exc).__name__ == "TrialPruned" and type(exc).__module__.startswith("optuna"):
                return PRUNED
            raise
        finally:
            trial.close()
    finally:
        if spec.warm:
            release_device_memory()


def kept_function(spec: TrialSpec) -> Callable | None:
    """The trial's function: as sent, and kept for the sweep's next trials on this warm rank (they
    are sent without it: a notebook function's globals, a dataset it reads, were pickled, sent and
    unpickled at every trial); when sent without, the one this rank kept (None: it keeps none)."""
    if spec.fn is not None and spec.sweep:
        _KEPT.clear()  # one sweep's at a time
        _KEPT[spec.sweep] = spec.fn
    return spec.fn if spec.fn is not None else _KEPT.get(spec.sweep)


def fresh_run() -> None:
    """A trial on a live rank starts as a launch's rank would: its metrics' steps from 0 (a
    pruner compares trials step by step), its batch size reported again."""
    ctx = context()
    ctx._steps.clear()
    ctx._reported_batch = False


def release_device_memory() -> None:
    """The memory torch's allocator keeps cached after a trial, given back to the GPU: the
    process stays for the next trial, and trials that share the GPU need what this one left."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class RemoteTrial:
    """Optuna's trial, in a rank: every call is answered by the study in the notebook.

    ``report`` counts on rank 0 only (each of a trial's ranks may call it, as each runs the same
    code); ``should_prune`` is the study's answer on every rank, so they stop together.
    """

    def __init__(self, number: int, environ: dict[str, str], rank: int = 0):
        self._number, self._rank = number, rank
        self._answers: queue.Queue = queue.Queue()
        self._name = number * NAME_STRIDE + rank
        self._link = Link(self._name, dict(environ), on_command=self._answers.put,
                          on_lost=lambda: self._answers.put(None))

    def _ask(self, method: str, *args, **kwargs):
        self._link.emit(protocol.TrialAsk(self._name, self._number, method, args, kwargs))
        try:
            answer = self._answers.get(timeout=ASK_SECONDS)
        except queue.Empty:
            raise TimeoutError(f"trial {self._number}: the notebook did not answer {method}() in "
                               f"{ASK_SECONDS:g} s") from None
        if answer is None:
            raise ConnectionError(f"trial {self._number}: the notebook's sweep closed its connection "
                                  f"(the sweep was stopped) during {method}()")
        if answer.error is not None:
            raise unpack_exception(answer.error) or RuntimeError(f"{method}() failed in the notebook")
        return answer.value

    def close(self) -> None:
        self._link.close()

    @property
    def number(self) -> int:
        return self._number

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        return self._ask("suggest_float", name, low, high, step=step, log=log)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return self._ask("suggest_int", name, low, high, step=step, log=log)

    def suggest_categorical(self, name: str, choices):
        return self._ask("suggest_categorical", name, choices)

    def suggest_uniform(self, name: str, low: float, high: float) -> float:
        return self._ask("suggest_uniform", name, low, high)

    def suggest_loguniform(self, name: str, low: float, high: float) -> float:
        return self._ask("suggest_loguniform", name, low, high)

    def suggest_discrete_uniform(self, name: str, low: float, high: float, q: float) -> float:
        return self._ask("suggest_discrete_uniform", name, low, high, q)

    def report(self, value: float, step: int) -> None:
        if self._rank == 0:
            self._ask("report", float(value), step)

    def should_prune(self) -> bool:
        return self._ask("should_prune")

    def set_user_attr(self, key: str, value) -> None:
        self._ask("set_user_attr", key, value)

    def set_system_attr(self, key: str, value) -> None:
        self._ask("set_system_attr", key, value)

    @property
    def params(self) -> dict:
        return self._ask("params")

    @property
    def distributions(self) -> dict:
        return self._ask("distributions")

    @property
    def user_attrs(self) -> dict:
        return self._ask("user_attrs")

    @property
    def system_attrs(self) -> dict:
        return self._ask("system_attrs")

    @property
    def datetime_start(self):
        return self._ask("datetime_start")

    def __repr__(self) -> str:
        return f"RemoteTrial(number={self._number})"
