"""A notebook cell as a job: the cell's code runs unchanged on every rank.

The names a cell reads that earlier cells defined travel with it: modules by name (`import x
as y`), everything else with dill in recurse mode, all in one pickle so that objects sharing
parts (a model and its optimizer) still share them on the rank. Where the ranks are separate
processes the cell runs as `__main__` in a fresh namespace holding those names; in the kernel
(dp, one device) and in forked ranks it runs in the kernel's own namespace, as a cell would.

Nothing here imports IPython: the magics parse options and call `run_cell`.
"""
from __future__ import annotations

import dataclasses
import linecache
import sys
import types
from collections.abc import Mapping
from typing import Any

from ...common.devices import plan_devices
from ...common.errors import UnpicklableError
from ...common.pickling import explain_pickling, ship_bytes
from ...common.source import free_names, shippable
from ...display import make_display
from ...rank.cell import CellJob
from ..run.choices import IN_KERNEL, choose, deepspeed_options
from ..run.launch import launch, launch_chosen
from ..run.options import RunOptions

IN_PLACE = (IN_KERNEL, "fork")  # starts that run the cell in the kernel's namespace (or its fork)


def _import_name(module: types.ModuleType) -> str | None:
    """The name that `import` finds this very module under, if any."""
    name = getattr(module, "__name__", None)
    if not name or name == "__main__" or sys.modules.get(name) is not module:
        return None
    return name


def cell_job(source: str, namespace: Mapping[str, Any], in_place: bool = False, hidden=()) -> CellJob:
    """The job for `source`, taking what it needs from the kernel's `namespace` (`in_place`: the
    cell runs in that namespace itself, in the kernel or a fork of it).

    Raises SyntaxError for a cell that is not plain Python, and `UnpicklableError` (naming
    each offending name by its path) before anything starts when a name cannot travel.
    """
    names = [n for n in free_names(source) if n in namespace and shippable(n, hidden)]
    if in_place:
        return CellJob(source, [], None, namespace)
    imports, values, sources = [], {}, {}
    for name in names:
        value = namespace[name]
        module = _import_name(value) if isinstance(value, types.ModuleType) else None
        if module:
            imports.append((name, module))
        else:
            values[name] = value
        code = getattr(value, "__code__", None)
        if code is not None and code.co_filename in linecache.cache:
            sources[code.co_filename] = linecache.cache[code.co_filename]
    return CellJob(source, imports, _pack_names(values) if values else None, sources=sources)


def _pack_names(values: dict) -> bytes:
    """One pickle for all names (shared parts stay shared); dill in recurse mode, as for `launch`."""
    try:
        return ship_bytes(values)
    except Exception as exc:
        # Paths start at the user's own names (`model.loss_fn`), checked one name at a time.
        findings = [f for name, value in values.items() for f in explain_pickling(value, "dill", name)]
        what = f"the names the cell uses from earlier cells ({', '.join(values)})"
        raise UnpicklableError(what, findings, detail=f"{type(exc).__name__}: {exc}") from exc


def run_cell(source: str, namespace: Mapping[str, Any], *, strategy: str = "auto", start: str = "auto",
             devices="auto", accelerator: str = "auto", num_nodes: int = 1, node_rank: int = 0,
             rdzv_endpoint: str | None = None, max_restarts: int = 0, launcher: str = "torchrun",
             timeout: float | None = None, stall: float | bool | None = None, progress=True, hidden=(),
             rerun_as: str | None = None, cluster=None, trackers=None, profile=None, run_dir=None):
    """Run a cell's code on every rank and return the `Result` (the last expression's value
    on each rank in `values`, rank 0's in `value`). What `%%nbtrain` calls; `strategy`, `start`
    and the rest as for `launch`, with torchrun's settings (`node_rank`, `rdzv_endpoint`,
    `launcher`) as arguments of their own: given, start='auto' is torchrun. `max_restarts` is
    torchrun's under torchrun, launch's otherwise; `stall` is launch's."""
    insight = {"trackers": trackers, "profile": profile, "run_dir": run_dir}
    if cluster is not None:
        job = cell_job(source, namespace, hidden=hidden)
        return launch(job, strategy=strategy, start=start, devices=devices, accelerator=accelerator,
                      num_nodes=num_nodes, timeout=timeout, stall=stall, progress=progress, cluster=cluster,
                      max_restarts=max_restarts, **insight)
    given = {k: v for k, v, default in (("launcher", launcher, "torchrun"), ("node_rank", node_rank, 0),
                                        ("rdzv_endpoint", rdzv_endpoint, None)) if v != default}
    # Checked as launch's are; `max_restarts` is torchrun's under torchrun, with the same bound.
    asked = RunOptions(strategy, start, devices, accelerator, num_nodes, None, timeout, stall, given or None,
                       max_restarts).asked
    plan = plan_devices(devices, accelerator, None, num_nodes)
    choice = choose(asked, plan)  # before the job: whether the cell runs in place depends on it
    if choice.start == "torchrun":  # the cell's torchrun settings, beside what the choice resolved
        options = {**choice.options, "launcher": choice.options.get("launcher", launcher), "node_rank": node_rank,
                   "rdzv_endpoint": rdzv_endpoint, "max_restarts": max_restarts,
                   **({"rerun_as": rerun_as} if rerun_as else {})}
        if choice.strategy == "deepspeed":
            options = deepspeed_options(options)  # refuses max_restarts: its launcher has none
        choice = dataclasses.replace(choice, options=options)
    job = cell_job(source, namespace, choice.start in IN_PLACE, hidden)
    display = make_display(progress)
    asked.say(display.note)
    return launch_chosen(job, (), {}, plan, choice, display, timeout=timeout, stall=stall,
                         max_restarts=0 if choice.start == "torchrun" else max_restarts, **insight)
