"""`launch()`: resolve devices, choose the strategy, run the ranks, return a `Result`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

from ...common.devices import DevicePlan, plan_devices
from ...common.errors import WorkerError
from ...display import make_display
from ...placements.base import Job
from ...placements.clusters import STRATEGIES as CLUSTER_STRATEGIES
from ...placements.clusters import ClusterJob, check_cluster
from .background import BackgroundRun, check_background, start_in_background
from .choices import Choice, choose
from .inprocess import InProcessLauncher
from .insight import instrument
from .options import RunOptions, refuse_foreign_keywords
from .pool import Pool
from .reloads import edited_since_loaded
from .restarts import with_restarts
from .result import Result
from .stalled import held, release_stalled
from .starts import launcher_for


@overload
def launch(fn: Callable, *args: Any, wait: Literal[True] = ..., **kwargs: Any) -> Result: ...
@overload
def launch(fn: Callable, *args: Any, wait: Literal[False], **kwargs: Any) -> BackgroundRun: ...
@overload
def launch(fn: Callable, *args: Any, wait: bool, **kwargs: Any) -> Result | BackgroundRun: ...


def launch(fn: Callable, *args, strategy: str = "auto", start: str = "auto", devices="auto",
           accelerator: str = "auto", num_nodes: int = 1, backend: str | None = None, timeout: float | None = None,
           progress=True, launcher_options: dict | None = None, cluster=None, trackers=None, profile=None,
           run_dir=None, max_restarts: int = 0, stall: float | bool | None = None, wait: bool = True,
           **kwargs) -> Result | BackgroundRun:
    """Run ``fn(*args, **kwargs)`` on every rank and return what the ranks gave back.

    Inside ``fn``, ``nbtrain.context()`` is this rank's `Context`. The call shows a live view
    while the ranks run and returns when every rank has ended; Ctrl-C stops every rank.

    Parameters
    ----------
    fn : callable
        The training function. It may be defined in the notebook (a lambda, a closure); what it
        uses travels with it.
    *args
        Positional arguments for ``fn``.
    strategy : {'auto', 'ddp', 'fsdp', 'dp', 'deepspeed'}, default 'auto'
        How ``ctx.setup`` wraps a model. 'auto': one device runs ``fn`` in this kernel, several
        wrap in DDP. 'ddp': DistributedDataParallel. 'fsdp': FSDP2 sharding. 'dp': DataParallel
        over the GPUs, in this kernel. 'deepspeed': ``fn`` calls ``deepspeed.initialize`` itself,
        under DeepSpeed's launcher. The earlier names 'ddp_fork', 'ddp_notebook', 'fork',
        'ddp_spawn', 'spawn' and 'ddp_script' still work (each is a strategy and a start).
    start : {'auto', 'fork', 'template', 'spawn', 'torchrun'}, default 'auto'
        Where the rank processes come from. 'fork': forks of this kernel (fastest; refused once
        CUDA is initialised here). 'template': forks of the warm template, a clean process
        (CUDA-safe, about as fast; see `warm_up`). 'spawn': fresh interpreters. 'torchrun': the
        job as a script under torchrun (``launcher_options`` for its settings, several machines).
        'auto': torchrun when ``launcher_options`` are given or ``num_nodes > 1``, else a fork
        of this kernel when that is safe, else the template; it says which in one line.
    devices : int, str, list or GpuPicker, default 'auto'
        Lightning's grammar: a count (``2``), ``-1`` (all), indices (``[0, 2]``, ``"0,2"``),
        ``"free:2"`` (GPUs nobody uses), ``"auto"`` (every visible GPU; one CPU rank), or a
        picker from `pick_gpus`. On CPU, a number of CPU ranks.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        'auto' is 'gpu' when a GPU is visible.
    num_nodes : int, default 1
        Machines taking part: more than one runs under torchrun (give ``rdzv_endpoint`` in
        ``launcher_options``) or on ``cluster``.
    backend : str, optional
        The process group's backend; default nccl on GPUs, gloo on CPU.
    timeout : float, optional
        Seconds before the run is stopped, with every rank's stack shown. None: no limit.
    stall : float or False, optional
        Seconds without progress on any rank (no collective, batch or progress step done) after
        which the live view and the cell say, once, where each rank is and whom the others wait
        for; the run goes on. None: max(60 s, 10x the recent step time); False: never.
    progress : bool, str or display, default True
        True or 'auto': widgets in Jupyter, text elsewhere; 'widgets', 'text'; False: no view
        (the ranks' output is still shown).
    launcher_options : dict, optional
        torchrun's settings with start='torchrun': ``node_rank``, ``rdzv_endpoint``
        (``"HOST:PORT"`` of node 0), ``max_restarts`` (torchrun's own restarts), ``launcher``
        ('torchrun', 'accelerate'; 'deepspeed' with strategy='deepspeed').
    cluster : Slurm or Ray, optional
        Run the ranks there: ``devices`` ranks on each of ``num_nodes`` nodes.
    trackers : str, tracker or list, optional
        Where ``ctx.log``'s values go besides the notebook: 'tensorboard', 'mlflow', 'wandb', or
        `TensorBoard`, `MLflow`, `WandB` objects.
    profile : bool or Profile, optional
        True, or a `Profile`: torch.profiler on every rank; the summary is ``Result.profile``.
    run_dir : str or Path, optional
        Where trackers and profiles write (default ./nbtrain-runs/<time>-<function>/); also
        ``ctx.run_dir``.
    max_restarts : int, default 0
        A failed run starts all ranks again, after a back-off, up to this many times (at most
        100); ``fn`` resumes from its own checkpoint. ``Result.restarts`` says why each happened.
    wait : bool, default True
        False: return at once with a `BackgroundRun` while the ranks train, the kernel free for
        other cells and the live view still updating; ``run.result()`` waits for the `Result`,
        and ``run.pause()``, ``call``, ``set``, ``stop`` steer the training at a step every rank
        agrees on (see docs/steering.md). Needs rank processes (not one device in the kernel),
        no ``max_restarts`` and no ``cluster``.
    **kwargs
        Keyword arguments for ``fn``. Names that ``launch`` takes itself (strategy, start,
        devices...) cannot reach ``fn`` this way: bind them with ``functools.partial``.

    Returns
    -------
    Result or BackgroundRun
        Rank 0's return value (``value``), every rank's (``values``), the logged metrics
        (``history``), the time taken, and how the run was made; with ``wait=False``, the
        `BackgroundRun` whose ``result()`` gives it.

    Raises
    ------
    WorkerError
        A rank failed (its traceback is shown), stalled past ``timeout``, or died; the message
        names the rank that failed first.
    ValueError
        A setting is not accepted (unknown words, a strategy and a start that do not go together,
        devices that are not there); nothing was started.
    TypeError
        ``fn`` is not callable, a setting has the wrong type, or ``fn`` cannot take the arguments
        given (a keyword it does not take is named with the option it resembles: ``stal=30``);
        nothing was started.
    NbtrainError
        Something ``fn`` uses cannot be sent to the ranks (not with start='fork'; also a
        TypeError): the message names each path. Or start='fork' while CUDA is initialised in this
        kernel (also a RuntimeError): the message names what initialised it.
    KeyboardInterrupt
        Ctrl-C: every rank was stopped.

    Examples
    --------
    >>> result = nbtrain.launch(train, 0.1, devices=2)                      # doctest: +SKIP
    >>> nbtrain.launch(train, 0.1, devices=2, strategy="fsdp", start="template")  # doctest: +SKIP
    """
    if not callable(fn):
        raise TypeError(f"launch(fn=...) needs a callable training function, got {type(fn).__name__}.")
    refuse_foreign_keywords(fn, args, kwargs, "launch")
    options = RunOptions(strategy, start, devices, accelerator, num_nodes, backend, timeout, stall, launcher_options,
                         max_restarts)
    if not isinstance(wait, bool):
        raise TypeError(f"launch(wait={wait!r}): give True (return the Result when the run ends) or False (return "
                        "a handle at once, the run going on in the background); a `wait` for the training function "
                        "is bound to it: launch(functools.partial(fn, wait=...)).")
    asked = options.asked
    insight = {"trackers": trackers, "profile": profile, "run_dir": run_dir}
    if cluster is not None:
        if not wait:
            raise ValueError("launch(wait=False) with cluster=...: a run on a cluster is not kept in the background "
                             "of this kernel; use nbtrain.submit(...) for a run that goes on without the cell.")
        return launch_on(cluster, fn, args, kwargs, options, progress=progress, **insight)
    plan = plan_devices(devices, accelerator, backend, num_nodes)
    choice = choose(asked, plan)
    if not wait:
        check_background(choice.start, max_restarts)
    display = make_display(progress)
    asked.say(display.note)
    if not wait:
        return launch_in_background(fn, args, kwargs, plan, choice, display, timeout=timeout, stall=stall, **insight)
    return launch_chosen(fn, args, kwargs, plan, choice, display, timeout=timeout, max_restarts=max_restarts,
                         stall=stall, **insight)


def _prepare(fn: Callable, args: tuple, kwargs: dict, plan: DevicePlan, choice: Choice, display, **insight):
    """The function as every rank runs it (`instrument`), once the view has said what to know."""
    fn = instrument(fn, args, kwargs, plan=plan, strategy=choice.strategy, **insight)
    if choice.note:
        display.note(choice.note)
    for line in edited_since_loaded():  # forks and fresh ranks would run different code
        display.note(line)
    return fn


def launch_in_background(fn: Callable, args: tuple, kwargs: dict, plan: DevicePlan, choice: Choice, display, *,
                         timeout: float | None, trackers=None, profile=None, run_dir=None,
                         stall: float | bool | None = None) -> BackgroundRun:
    """`launch(wait=False)`: the ranks started from here, watched from a thread of their own."""
    fn = _prepare(fn, args, kwargs, plan, choice, display, trackers=trackers, profile=profile, run_dir=run_dir)
    job = Job(fn, args, kwargs, plan, choice.strategy, timeout, stall, options=dict(choice.options), start=choice.start)
    launcher = launcher_for(choice.start, display, job)
    return start_in_background(launcher, job, display, lambda pool, watch: run_to_end(pool, job, display, watch))


def launch_chosen(fn: Callable, args: tuple, kwargs: dict, plan: DevicePlan, choice: Choice, display, *,
                  timeout: float | None, max_restarts: int, trackers=None, profile=None, run_dir=None,
                  stall: float | bool | None = None) -> Result:
    """`launch` once the plan and the (strategy, start) pair are known (a cell's job depends on them)."""
    fn = _prepare(fn, args, kwargs, plan, choice, display, trackers=trackers, profile=profile, run_dir=run_dir)

    def attempt() -> Result:  # a new job each time: nothing of a failed attempt is reused
        job = Job(fn, args, kwargs, plan, choice.strategy, timeout, stall, options=dict(choice.options),
                  start=choice.start)
        launcher = launcher_for(choice.start, display, job)
        if isinstance(launcher, InProcessLauncher):
            return launcher.launch(job, display)
        return run_once(launcher, job, display)

    return with_restarts(attempt, max_restarts, display)


def run_once(launcher, job: Job, display) -> Result:
    """Start the ranks with `job.fn` as their one command, watch it, stop them: a `Result`."""
    pool = Pool(launcher, job, live=False)
    return run_to_end(pool, job, display, lambda: pool.start(display, job.timeout))


def run_to_end(pool: Pool, job: Job, display, watch: Callable[[], object]) -> Result:
    """`watch()` the run (its start too, unless started already), then stop the ranks: a `Result`."""
    ok = False
    release_stalled()  # ranks an earlier launch left stuck for %debug: their devices are this one's
    try:
        watch()
        ok = True
    finally:
        # Every rank may have reported while their processes still take seconds to end (a
        # library's teardown, torchrun, a SLURM job): the view would read "finished" while the
        # cell still runs, so the close says what it waits for.
        if not held(pool):  # stuck past timeout=, kept for %debug (stalled.StalledRanks ends them)
            pool.close(ok, display, exit_note=display.note)
        if pool.state is not None:  # None: it failed in its checks, before anything was shown
            display.finish(pool.state, ok)
    assert pool.state is not None, "a pool that ran has its state"
    return Result.from_state(pool.state, job.strategy, job.plan.describe(), job.start)


def launch_on(cluster, fn, args: tuple, kwargs: dict, options: RunOptions, *, progress, trackers=None, profile=None,
              run_dir=None):
    """`launch(..., cluster=...)`: the same run, its ranks placed by the cluster's engine. A restart
    is a new placement (a new SLURM job, new Ray actors); the failed one is gone before it starts."""
    cluster = check_cluster(cluster)
    asked, timeout, stall = options.asked, options.timeout, options.stall
    check_cluster_words(asked, cluster)
    plan = cluster.plan(options.devices, options.accelerator, options.backend, options.num_nodes)
    strategy = "ddp" if asked.strategy == "auto" else asked.strategy
    fn = instrument(fn, args, kwargs, trackers=trackers, profile=profile, run_dir=run_dir, plan=plan, strategy=strategy)
    display = make_display(progress)
    asked.say(display.note)

    def attempt() -> Result:  # run_once returns once the engine let go of the ranks (the job left the queue)
        job = ClusterJob(fn, args, kwargs, plan, strategy, timeout, stall, start=cluster.engine)
        return run_once(cluster.placement(), job, display)

    # Only the ranks' failures restart: the engine's refusals (a job that can never start) would only repeat.
    return with_restarts(attempt, options.max_restarts, display, only=WorkerError)


def check_cluster_words(asked, cluster) -> None:
    """On a cluster the engine starts the ranks, each a process of its own, wrapped by DDP or FSDP."""
    if asked.strategy not in CLUSTER_STRATEGIES:
        raise ValueError(f"strategy={asked.strategy!r} with cluster={cluster!r}: the engine starts the ranks, each a "
                         "process of its own; give strategy='auto' or 'ddp' (ctx.setup wraps models in DDP), or "
                         "'fsdp' (ctx.setup shards them).")
    if asked.start != "auto":
        raise ValueError(f"{asked.start_said} with cluster={cluster!r}: the cluster's engine starts the ranks; "
                         "give start='auto' (or leave it out).")
    if asked.options:
        raise ValueError(f"launcher_options={asked.options!r} are for ranks started on this machine; with a cluster, "
                         "give the engine's settings to the cluster object.")
