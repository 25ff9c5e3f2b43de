"""`launch()`: resolve devices, choose the strategy, run the ranks, return a `Result`."""
from __future__ import annotations

from typing import Callable

from .devices import DevicePlan, plan_devices
from .display import make_display
from .launchers.base import Job
from .preflight import fork_blocker
from .result import Result

STRATEGIES = ("auto", "dp", "ddp_fork", "ddp_spawn", "ddp", "fsdp", "deepspeed")
ALIASES = {"ddp_notebook": "ddp_fork", "fork": "ddp_fork", "spawn": "ddp_spawn", "ddp_script": "ddp"}


def _launcher(placement: str):
    from .launchers.inprocess import InProcessLauncher
    from .launchers.processes import ForkLauncher, SpawnLauncher

    table = {"single": InProcessLauncher, "dp": InProcessLauncher, "ddp_fork": ForkLauncher,
             "ddp_spawn": SpawnLauncher}
    if placement == "ddp":
        from .launchers.script import ScriptLauncher

        return ScriptLauncher()
    return table[placement]()


def _processes(plan: DevicePlan, strategy: str) -> tuple[str, str]:
    """Rank processes forked from the kernel when that is safe, else spawned; and why."""
    blocker = fork_blocker()
    if blocker is None:
        return "ddp_fork", f"strategy {strategy!r} -> ddp_fork ({plan.describe()})"
    # The blocker names its cause (the cell line or import that initialised CUDA).
    return "ddp_spawn", f"strategy {strategy!r} -> ddp_spawn ({plan.describe()}), not ddp_fork: {blocker}"


def deepspeed_options(given: dict | None) -> dict:
    """strategy='deepspeed' runs as a script under DeepSpeed's own launcher."""
    options = dict(given or {})
    if options.get("launcher") not in (None, "deepspeed"):
        raise ValueError(f"strategy='deepspeed' runs under DeepSpeed's launcher; launcher={options['launcher']!r} "
                         "is for strategy='ddp'.")
    if options.get("max_restarts"):
        raise ValueError(f"max_restarts={options['max_restarts']!r}: DeepSpeed's launcher does not restart ranks; "
                         "strategies 'ddp' and 'fsdp' (torchrun) do.")
    return {**options, "launcher": "deepspeed"}


def resolve_strategy(strategy: str, plan: DevicePlan) -> tuple[str, str | None]:
    """(strategy to run, a one-line note on why) for the requested strategy and plan."""
    name = ALIASES.get(strategy, strategy) if isinstance(strategy, str) else strategy
    if name not in STRATEGIES:
        accepted = ", ".join(repr(s) for s in (*STRATEGIES, *ALIASES))
        raise ValueError(f"strategy={strategy!r} is not known. Accepted: {accepted}.")
    if plan.num_nodes > 1 and name not in ("ddp", "fsdp"):
        raise ValueError(f"num_nodes={plan.num_nodes} needs strategy='ddp' or 'fsdp' (torchrun's rendezvous "
                         f"across machines); {name!r} runs on this machine only.")
    if name == "dp" and plan.accelerator == "cpu" and plan.nprocs > 1:
        raise ValueError(f"strategy='dp' runs one process; on CPU it cannot use {plan.nprocs} devices. "
                         "Use devices=1, or strategy='ddp_fork'/'ddp_spawn' for several CPU ranks.")
    if name != "auto":
        return name, None
    if plan.world_size == 1:
        return "single", f"strategy 'auto' -> in this kernel ({plan.describe()})"
    return _processes(plan, "auto")


def launch(fn: Callable, *args, strategy: str = "auto", devices="auto", accelerator: str = "auto",
           num_nodes: int = 1, backend: str | None = None, timeout: float | None = None,
           progress=True, launcher_options: dict | None = None, **kwargs) -> Result:
    """Run `fn(*args, **kwargs)` on every rank and return a `Result`.

    Inside `fn`, `nbtrain.context()` is this rank's Context. Keyword arguments that `launch`
    itself takes (strategy, devices, ...) cannot reach `fn` this way: bind them with
    `functools.partial`. `launcher_options` (strategy 'ddp' only) are the script launcher's
    settings: node_rank, rdzv_endpoint, max_restarts, launcher; see `launchers/script.py`.
    Strategy 'fsdp' (FSDP2 sharding in `ctx.setup`) starts its ranks as 'auto' would, or as a
    script under the launcher when `launcher_options` are given (or num_nodes > 1). Strategy
    'deepspeed' runs the job as a script under DeepSpeed's launcher; `fn` calls
    `deepspeed.initialize` itself.
    """
    if not callable(fn):
        raise TypeError(f"launch(fn=...) needs a callable training function, got {type(fn).__name__}.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout={timeout!r}: give a positive number of seconds, or None for no limit.")
    plan = plan_devices(devices, accelerator, backend, num_nodes)
    name, note = resolve_strategy(strategy, plan)
    placement = name
    if name == "fsdp":  # the strategy shards; where its ranks run is decided as for the others
        script = launcher_options is not None or plan.num_nodes > 1
        placement, note = ("ddp", None) if script else _processes(plan, name)
    if name == "deepspeed":
        placement, launcher_options = "ddp", deepspeed_options(launcher_options)
    elif (launcher_options or {}).get("launcher") == "deepspeed":
        raise ValueError("launcher='deepspeed' runs strategy='deepspeed' (the job calls deepspeed.initialize); "
                         f"strategy {strategy!r} runs under torchrun or accelerate.")
    if launcher_options and placement != "ddp":
        raise ValueError(f"launcher_options={launcher_options!r} apply to strategy='ddp' (the script launcher) "
                         f"only; strategy {strategy!r} runs {name!r}.")
    display = make_display(progress)
    if note:
        display.note(note)
    job = Job(fn, args, kwargs, plan, name, timeout, options=dict(launcher_options or {}))
    return _launcher(placement).launch(job, display)
