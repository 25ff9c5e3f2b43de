"""`launch()`: resolve devices, choose the strategy, run the ranks, return a `Result`."""
from __future__ import annotations

import threading
from typing import Callable

from ..common.devices import DevicePlan, plan_devices
from ..common.errors import WorkerError
from ..common.preflight import fork_blocker
from ..display import make_display
from ..placements.base import Job
from ..placements.clusters import STRATEGIES as CLUSTER_STRATEGIES
from ..placements.clusters import ClusterJob, check_cluster
from ..placements.processes import ForkLauncher, SpawnLauncher
from ..placements.script import ScriptLauncher
from ..placements.template import start_ranks_cleanly
from .inprocess import InProcessLauncher
from .insight import instrument
from .pool import Pool
from .restarts import check_restarts, with_restarts
from .result import Result

STRATEGIES = ("auto", "dp", "ddp_fork", "ddp_spawn", "ddp", "fsdp", "deepspeed")
ALIASES = {"ddp_notebook": "ddp_fork", "fork": "ddp_fork", "spawn": "ddp_spawn", "ddp_script": "ddp"}


def _launcher(placement: str, job: Job, display):
    """The launcher for where the ranks run: in the kernel, forked, spawned, or a script ('ddp')."""
    if placement == "ddp":
        return ScriptLauncher()
    if placement == "ddp_spawn":
        if not job.options.pop("template", True):
            return SpawnLauncher()  # plain spawn: fresh interpreters, for code that breaks even in a clean fork
        return start_ranks_cleanly(display, job)  # checks the job pickles before starting the template
    return {"single": InProcessLauncher, "dp": InProcessLauncher, "ddp_fork": ForkLauncher}[placement]()


def _processes(plan: DevicePlan, strategy: str) -> tuple[str, str]:
    """Ranks forked from the kernel when that is safe, else spawned; and a note saying so.

    Each note starts with the run's title ("<strategy> on <devices>"), so a display that shows
    the title says the choice on that one line instead of repeating it (see LineDisplay.start).
    """
    blocker = fork_blocker()
    placement = "ddp_fork" if blocker is None else "ddp_spawn"
    if strategy == "auto":
        note = f"{placement} on {plan.describe()} (chosen by strategy='auto')"
    else:
        note = f"{strategy} on {plan.describe()} (ranks started by {placement}, as strategy='auto' would)"
    # The blocker names its cause (the cell line or import that initialised CUDA).
    return placement, note if blocker is None else f"{note}, not ddp_fork: {blocker}"


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


def _check_launcher_options(options: dict | None, name: str, strategy: str) -> dict:
    options = dict(options or {})
    if name == "ddp_spawn" and set(options) <= {"template"}:
        if not isinstance(options.get("template", True), bool):
            raise ValueError(f"launcher_options={{'template': {options['template']!r}}}: give True (ranks forked "
                             "from the warm template, the default) or False (plain spawn).")
        return options
    if options and name != "ddp":
        raise ValueError(f"launcher_options={options!r} apply to strategy='ddp' (the script launcher: node_rank, "
                         "rdzv_endpoint, max_restarts, launcher) and strategy='ddp_spawn' ({'template': False} for "
                         f"plain spawn) only; strategy {strategy!r} runs {name!r}.")
    return options


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
    # Each note starts with the run's title ("<strategy> on <devices>"), see `_processes`.
    if plan.world_size == 1:
        return "single", f"single on {plan.describe()} (chosen by strategy='auto': one device runs in this kernel)"
    return _processes(plan, "auto")


def check_timeout(timeout):
    """`timeout` as given, once it is a positive number of seconds (or None: no limit)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):  # so nan too: it is not "no limit"
        raise ValueError(f"timeout={timeout!r}: give a positive number of seconds, or None for no limit.")
    return timeout


def launch(fn: Callable, *args, strategy: str = "auto", devices="auto", accelerator: str = "auto",
           num_nodes: int = 1, backend: str | None = None, timeout: float | None = None,
           progress=True, launcher_options: dict | None = None, cluster=None, trackers=None, profile=None,
           run_dir=None, max_restarts: int = 0, **kwargs) -> Result:
    """Run `fn(*args, **kwargs)` on every rank and return a `Result`.

    Inside `fn`, `nbtrain.context()` is this rank's Context. Keyword arguments that `launch`
    itself takes (strategy, devices, ...) cannot reach `fn` this way: bind them with
    `functools.partial`. `launcher_options` are the script launcher's settings with strategy
    'ddp' (node_rank, rdzv_endpoint, max_restarts, launcher; see `nbtrain/placements/script.py`), and
    with 'ddp_spawn' `{"template": False}` starts plain spawned interpreters instead of forks
    of the warm template (see `nbtrain.warm_up`).
    Strategy 'fsdp' (FSDP2 sharding in `ctx.setup`) starts its ranks as 'auto' would, or as a
    script under the launcher when `launcher_options` are given (or num_nodes > 1). Strategy
    'deepspeed' runs the job as a script under DeepSpeed's launcher; `fn` calls
    `deepspeed.initialize` itself.
    `cluster` runs the ranks elsewhere: `nbtrain.Slurm(...)` or `nbtrain.Ray(...)` (see nbtrain/placements/clusters).
    `trackers` ("tensorboard", "mlflow", "wandb" or their settings objects) receive `ctx.log`'s
    values; `profile` (True or `nbtrain.Profile(...)`) records torch.profiler on every rank into
    `Result.profile`. Both write under `run_dir` (default ./nbtrain-runs/<time>-<function>/).
    `max_restarts=N`: a failed run starts all ranks again, up to N times; the code resumes from its
    own checkpoint (`Result.restarts` says why each restart happened).
    """
    if not callable(fn):
        raise TypeError(f"launch(fn=...) needs a callable training function, got {type(fn).__name__}.")
    check_timeout(timeout)
    check_restarts(max_restarts)
    insight = {"trackers": trackers, "profile": profile, "run_dir": run_dir}
    if cluster is not None:
        return launch_on(cluster, fn, args, kwargs, strategy=strategy, devices=devices, accelerator=accelerator,
                         num_nodes=num_nodes, backend=backend, timeout=timeout, progress=progress,
                         launcher_options=launcher_options, max_restarts=max_restarts, **insight)
    plan = plan_devices(devices, accelerator, backend, num_nodes)
    name, note = resolve_strategy(strategy, plan)
    fn = instrument(fn, args, kwargs, plan=plan, strategy=name, **insight)
    placement = name  # where the ranks run; `name` (the Context's strategy) says how models are wrapped
    if name == "fsdp":
        script = launcher_options is not None or plan.num_nodes > 1
        placement, note = ("ddp", None) if script else _processes(plan, name)
    elif name == "deepspeed":
        placement, launcher_options = "ddp", deepspeed_options(launcher_options)
    elif (launcher_options or {}).get("launcher") == "deepspeed":
        raise ValueError("launcher='deepspeed' runs strategy='deepspeed' (the job calls deepspeed.initialize); "
                         f"strategy {strategy!r} runs under torchrun or accelerate.")
    options = _check_launcher_options(launcher_options, placement, strategy)
    display = make_display(progress)
    if note:
        display.note(note)

    def attempt() -> Result:  # a new job each time: nothing of a failed attempt is reused
        job = Job(fn, args, kwargs, plan, name, timeout, options=dict(options))
        launcher = _launcher(placement, job, display)
        if isinstance(launcher, InProcessLauncher):
            return launcher.launch(job, display)
        return run_once(launcher, job, display)

    return with_restarts(attempt, max_restarts, display)


CLOSE_NOTE_AFTER = 2.0  # seconds after the ranks reported before the cell says it waits for their exit
CLOSE_NOTE = "every rank has reported; waiting for their processes to exit"

def run_once(launcher, job: Job, display) -> Result:
    """Start the ranks with `job.fn` as their one command, watch it, stop them: a `Result`."""
    pool = Pool(launcher, job, live=False)
    ok = False
    try:
        pool.start(display, job.timeout)
        ok = True
    finally:
        # Every rank may have reported while their processes still take seconds to end (a
        # library's teardown, torchrun, a SLURM job): the view would read "finished" while the
        # cell still runs. Say what it waits for.
        waiting = threading.Timer(CLOSE_NOTE_AFTER, display.note, (CLOSE_NOTE,)) if ok else None
        if waiting is not None:
            waiting.daemon = True
            waiting.start()
        try:
            pool.close(ok, display)
        finally:
            if waiting is not None:
                waiting.cancel()
                waiting.join()  # gone when launch returns: a launch leaves no thread behind
        if pool.state is not None:  # None: it failed in its checks, before anything was shown
            display.finish(pool.state, ok)
    return Result.from_state(pool.state, job.strategy, job.plan.describe())


def launch_on(cluster, fn, args: tuple, kwargs: dict, *, strategy: str, devices, accelerator: str, num_nodes: int,
              backend: str | None, timeout: float | None, progress, launcher_options: dict | None,
              trackers=None, profile=None, run_dir=None, max_restarts: int = 0):
    """`launch(..., cluster=...)`: the same run, its ranks placed by the cluster's engine. A restart
    is a new placement (a new SLURM job, new Ray actors); the failed one is gone before it starts."""
    cluster = check_cluster(cluster)
    if strategy not in CLUSTER_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} with cluster={cluster!r}: the engine starts the ranks, each a process "
                         "of its own; give strategy='auto' or 'ddp' (ctx.setup wraps models in DDP), or 'fsdp' "
                         "(ctx.setup shards them).")
    if launcher_options:
        raise ValueError(f"launcher_options={launcher_options!r} are for ranks started on this machine; with a cluster, "
                         "give the engine's settings to the cluster object.")
    plan = cluster.plan(devices, accelerator, backend, num_nodes)
    strategy = "ddp" if strategy == "auto" else strategy
    fn = instrument(fn, args, kwargs, trackers=trackers, profile=profile, run_dir=run_dir, plan=plan, strategy=strategy)
    display = make_display(progress)

    def attempt() -> Result:  # run_once returns once the engine let go of the ranks (the job left the queue)
        return run_once(cluster.placement(), ClusterJob(fn, args, kwargs, plan, strategy, timeout), display)

    # Only the ranks' failures restart: the engine's refusals (a job that can never start) would only repeat.
    return with_restarts(attempt, max_restarts, display, only=WorkerError)
