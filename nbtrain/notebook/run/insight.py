"""What `trackers=` and `profile=` add to a run: the run directory, its settings, the wrapped function.

Only plain settings are made here (no tracker or profiler is imported in the notebook): the
ranks open them (`rank/instrument.py`).
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

from ...common.private import private_dir
from ...common.runlog import new_run_dir
from ...rank.instrument import Instrumented
from ...rank.profiling import Profile
from ...rank.trackers import MLflow, check_trackers

PLAIN = (int, float, str, bool, type(None))
RUNS = "nbtrain-runs"  # the default parent of run directories, in the notebook's working directory


def instrument(fn, args: tuple, kwargs: dict, *, trackers, profile, run_dir, plan, strategy: str):
    """`fn` as is when neither trackers nor a profile are asked for; else an `Instrumented`."""
    trackers, profile = check_trackers(trackers), Profile.check(profile)
    if not trackers and profile is None:
        if run_dir is not None:
            check_run_dir(run_dir)
        return fn
    name = function_name(fn)
    if run_dir is None:  # a new one, never another run's (a submit's, or a launch's in the same second)
        run_dir = str(new_run_dir(Path(RUNS).absolute(), name))  # 0700
    else:
        run_dir = os.path.abspath(check_run_dir(run_dir))
        private_dir(Path(run_dir))  # its trackers record the run's arguments: only its user reads them
    # The URI as this notebook has it: ranks elsewhere (a cluster) may not share its environment.
    trackers = tuple(MLflow(os.environ.get("MLFLOW_TRACKING_URI"), t.experiment, t.run_name)
                     if isinstance(t, MLflow) and t.tracking_uri is None and os.environ.get("MLFLOW_TRACKING_URI")
                     else t for t in trackers)
    settings = {"strategy": strategy, "devices": plan.describe(), "world_size": plan.world_size,
                "accelerator": plan.accelerator, "backend": plan.backend, **plain_arguments(fn, args, kwargs)}
    return Instrumented(fn, trackers, profile, run_dir, os.path.basename(run_dir), settings)


def check_run_dir(run_dir) -> str:
    if not isinstance(run_dir, (str, os.PathLike)) or not str(run_dir):
        raise ValueError(f"run_dir={run_dir!r}: give a directory path (a str or pathlib.Path).")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"run_dir={str(run_dir)!r} is a file; give a directory (it is made if missing).")
    return os.fspath(run_dir)


def plain_arguments(fn, args: tuple, kwargs: dict) -> dict:
    """The function's arguments that are plain values (numbers, strings), by parameter name."""
    try:
        call = inspect.signature(fn).bind_partial(*args, **kwargs)
        call.apply_defaults()
        bound = call.arguments
    except (TypeError, ValueError):  # no signature, or one these arguments do not fit
        bound = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return {k: v for k, v in bound.items() if isinstance(v, PLAIN)}


def function_name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "run"
