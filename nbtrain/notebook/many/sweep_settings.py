"""A sweep's settings, each checked before anything runs and refused in one line saying what is
accepted: the space, whether the objective takes Optuna's trial, `catch`, `stop_after` (and its
earlier name), and a cluster's slots. `submit(sweep, ...)` checks them too, before anything is
written. Optuna itself is imported here, once, with the line that says how to install it.
"""
from __future__ import annotations

import inspect
import warnings

from ..run.insight import function_name
from ..run.options import check_count
from .slots import Slot
from .sweep_study import study_name

OPTUNA_MISSING = "nbtrain.sweep runs on Optuna, which is not installed: pip install 'nbtrain[sweep]' (or optuna)."
DIRECTIONS = ("minimize", "maximize")


def require_optuna():
    """Optuna, or an ImportError that says how to install it."""
    try:
        import optuna
    except ImportError as exc:
        raise ImportError(OPTUNA_MISSING) from exc
    return optuna


def check_space(space, optuna) -> dict | None:
    example = "e.g. {'lr': optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}"
    if space is None:
        return None
    if not isinstance(space, dict) or not space:
        raise ValueError(f"space={space!r}: give a dict mapping parameter names to Optuna distributions, {example}, "
                         "or none when fn takes Optuna's trial (fn(trial) calls trial.suggest_*).")
    for name, distribution in space.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"space key {name!r}: a parameter name is passed as fn's keyword, "
                             "so it must be an identifier.")
        if not isinstance(distribution, optuna.distributions.BaseDistribution):
            raise ValueError(f"space[{name!r}]={distribution!r}: give an Optuna distribution (FloatDistribution, "
                             f"IntDistribution, CategoricalDistribution), {example}.")
    return dict(space)


def takes_trial(fn, space) -> bool:
    """Whether `fn` is called as Optuna calls an objective, `fn(trial)`: always without a space;
    with one, when its first parameter is named `trial` or annotated as Optuna's trial."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: called with the space's keywords, or refused below
        return space is None
    if space is None:
        try:
            signature.bind(None)
        except TypeError:
            raise ValueError(f"sweep({study_name(fn)}{signature}): with no space=, fn is called as Optuna calls an "
                             "objective, fn(trial), and asks trial.suggest_*() for its parameters; give a space= "
                             "of Optuna distributions to call it as fn(**params) instead.") from None
        return True
    positional = [p for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not positional:
        return False
    first = positional[0]
    hint = first.annotation if isinstance(first.annotation, str) else getattr(first.annotation, "__qualname__", "")
    return first.name == "trial" or hint.rsplit(".", 1)[-1] in ("Trial", "BaseTrial", "FrozenTrial")


def check_catch(catch) -> tuple:
    given, catch = catch, catch if isinstance(catch, tuple) else (catch,)
    if not all(isinstance(c, type) and issubclass(c, BaseException) for c in catch):
        raise ValueError(f"catch={given!r}: give an exception class or a tuple of them (a trial raising one is "
                         "recorded as failed and the sweep goes on), or () to stop at the first failure.")
    return catch


def renamed_timeout(timeout, stop_after):
    """`timeout=` is `stop_after=` in a sweep (until 0.3): a launch's `timeout=` stops a run, which
    a sweep's never did."""
    if timeout is None:
        return stop_after
    if stop_after is not None:
        raise ValueError(f"sweep(timeout={timeout!r}, stop_after={stop_after!r}): timeout= is the earlier name of "
                         "stop_after=; give stop_after= alone.")
    warnings.warn("sweep(timeout=...) is now stop_after=... (seconds after which no new trial starts); timeout= "
                  "still works until nbtrain 0.3.", DeprecationWarning, stacklevel=3)
    return timeout


def check_sweep(fn, space, trials, metric, direction, sampler, pruner, stop_after, catch) -> tuple[dict | None, tuple,
                                                                                                  bool]:
    """The sweep's settings checked, each refused in one line: (space, catch, whether fn takes a
    trial) as the sweep uses them. `submit(sweep, ...)` checks them too, before anything is written."""
    optuna = require_optuna()
    if not callable(fn):
        raise TypeError(f"sweep(fn=...) needs a callable trial function, got {type(fn).__name__}.")
    space = check_space(space, optuna)
    with_trial = takes_trial(fn, space)
    check_count(trials, "trials")
    if metric is None and not with_trial:
        raise ValueError(f"metric=None: sweep({function_name(fn)}, space, ...) needs the name fn logs with "
                         "ctx.log(name, value), e.g. metric='loss' (or write fn as Optuna's objective(trial), which "
                         "returns its value).")
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise ValueError(f"metric={metric!r}: give the name fn logs with ctx.log(name, value), e.g. metric='loss'.")
    if direction is not None and direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: give 'minimize' or 'maximize'.")
    if sampler is not None and not isinstance(sampler, optuna.samplers.BaseSampler):
        raise ValueError(f"sampler={sampler!r}: give an Optuna sampler (optuna.samplers.TPESampler(), ...) or None.")
    if pruner is not None and not isinstance(pruner, optuna.pruners.BasePruner):
        raise ValueError(f"pruner={pruner!r}: give an Optuna pruner (optuna.pruners.MedianPruner(), ...) or None.")
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, (int, float))
                                   or not stop_after > 0):
        raise ValueError(f"stop_after={stop_after!r}: give a positive number of seconds (no new trial starts after "
                         "them), or None for no limit.")
    return space, check_catch(catch), with_trial


def cluster_slots(devices, per_slot: int, accelerator: str) -> list[Slot]:
    """On a cluster, `devices` is how many devices the sweep may hold at once: slots of `per_slot`."""
    check_count(per_slot, "devices_per_trial")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < per_slot:
        raise ValueError(f"devices={devices!r} with cluster=: give how many devices the sweep may hold at once on the "
                         f"cluster, an int >= devices_per_trial ({per_slot}).")
    return [Slot(i, accelerator, (), per_slot) for i in range(devices // per_slot)]
