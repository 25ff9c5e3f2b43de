"""`submit()`: a run that outlives the kernel. Its job goes to a new run directory and a
supervisor in its own session (`detached/supervise.py`) runs it; the returned `Run` follows it there.

The run directory is written whole: its files go to a partial directory that is renamed into
place once they are all there (`runlog.partial_dir`), so a kernel killed half-way leaves no
half-run that `runs()` or `attach` would meet, only a partial directory that names its writer.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ...common import runlog, session
from ...common.devices import plan_devices
from ...common.pickling import ship_bytes
from ...common.private import check_own, private_dir
from ...common.transfer import pack_job
from ...display import check_progress
from ...placements.clusters import Slurm, check_cluster
from ...placements.template_process import template, warm_in_background
from ...rank.profiling import Profile
from ...rank.trackers import check_trackers
from ..many.slots import plan_slots, slot_start
from ..many.sweep import check_sweep, renamed_timeout, sweep
from ..run.choices import choose
from ..run.doctor import check_stall
from ..run.launch import check_cluster_words
from ..run.options import RunOptions, check_timeout, refuse_foreign_keywords
from ..run.restarts import check_restarts
from .runs import Run

RUNS = "nbtrain-runs"

# Started by a short-lived intermediate process, so the supervisor is not the kernel's child:
# it is re-parented away at once, and no zombie of it waits in the kernel for a wait() that a
# dropped Run would never make. It records the supervisor at once (the supervisor does too, when
# it starts): a kernel killed now leaves a run that cancel() finds.
_DETACH = ("import subprocess, sys; from pathlib import Path; from nbtrain.common import runlog, session; "
           "log = open(sys.argv[1], 'ab'); "
           "p = subprocess.Popen(sys.argv[3:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, "
           "stderr=log, close_fds=True); "
           "runlog.write_json(Path(sys.argv[2]), session.identity(p.pid)); print(p.pid)")
# -P: the import path is the kernel's alone (PYTHONPATH below), not this directory first.
_SUPERVISE = "import sys; from nbtrain.notebook.detached.supervise import main; sys.exit(main(sys.argv[1]))"


def submit(fn: Callable, *args, strategy: str = "auto", start: str = "auto", devices="auto",
           accelerator: str = "auto", num_nodes: int = 1, backend: str | None = None, timeout: float | None = None,
           launcher_options: dict | None = None, cluster=None, trackers=None, profile=None, run_dir=None,
           max_restarts: int = 0, progress=True, stall: float | bool | None = None, **kwargs) -> Run:
    """Run ``fn(*args, **kwargs)`` as `launch` would, in processes that outlive this kernel.

    Returns at once. A supervisor process of its own (a SLURM batch job with ``cluster=Slurm(...)``)
    runs the launch; what the ranks report, the result or the error go to the run directory, so
    `attach` follows the run from any later kernel, and `runs` lists it.

    Parameters
    ----------
    fn : callable
        The training function, as for `launch`; it is pickled now (with what it uses). Or
        `nbtrain.sweep`, followed by the trial function, the space and the sweep's keywords
        (``submit(nbtrain.sweep, train, space, trials=20, metric="loss", devices=2)``): the
        supervisor runs the sweep, its study SQLite in the run directory; ``result()`` is the
        `Sweep`, and the `Run` shows the study's trials. ``devices``, ``accelerator``,
        ``strategy``, ``start`` and ``cluster`` are the sweep's (its ``stop_after=`` goes with the
        sweep's keywords; ``timeout=`` here is its earlier name).
    *args
        Positional arguments for ``fn``.
    strategy : {'auto', 'ddp', 'fsdp', 'dp', 'deepspeed'}, default 'auto'
        How ``ctx.setup`` wraps a model, as for `launch` (the earlier names work too).
    start : {'auto', 'fork', 'template', 'spawn', 'torchrun'}, default 'auto'
        Where the rank processes come from, as for `launch`; 'auto' is decided by the supervisor
        (a fresh process: a fork of it is safe).
    devices : int, str or list, default 'auto'
        As for `launch`.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        As for `launch`.
    num_nodes : int, default 1
        As for `launch`.
    backend : str, optional
        As for `launch`.
    timeout : float, optional
        Seconds before the run is stopped (each attempt), with every rank's stack in its logs.
    launcher_options : dict, optional
        torchrun's settings with start='torchrun', as for `launch`.
    cluster : Slurm or Ray, optional
        With `Slurm`, the supervisor is a SLURM batch job itself, which submits the ranks' job: the
        run outlives this machine's session too. With `Ray`, the supervisor runs on this machine
        and the run outlives the kernel (not this machine).
    trackers : str, tracker or list, optional
        As for `launch`, writing under the run directory.
    profile : bool or Profile, optional
        As for `launch`, writing under the run directory.
    run_dir : str or Path, optional
        A new or empty directory of yours for the run; default a new one under ./nbtrain-runs/.
        ``ctx.run_dir`` in the ranks, where the code keeps the checkpoints it resumes from.
    max_restarts : int, default 0
        A failed attempt starts all ranks again, after a back-off, up to this many times.
    progress : bool or str, default True
        How the returned `Run` draws itself (as ``launch(progress=...)``).
    stall : float or False, optional
        As for `launch`: seconds without progress on any rank after which the run's logs and its
        live view say where each rank is and whom the others wait for.
    **kwargs
        Keyword arguments for ``fn``.

    Returns
    -------
    Run
        The run, followed from its directory: its live view when shown, ``result()`` to wait.

    Raises
    ------
    ValueError
        A setting is not accepted (as in `launch`); nothing was written or started.
    TypeError
        ``fn`` is not callable, ``run_dir`` is not a path, or ``fn`` cannot take the arguments given
        (a keyword it does not take is named with the option it resembles).
    FileExistsError
        ``run_dir`` exists and is not empty.
    NbtrainError
        ``fn`` or its arguments cannot be pickled (also a TypeError); nothing was written.
    RuntimeError
        sbatch refused the supervisor's job (with ``cluster=Slurm(...)``).
    """
    if not callable(fn):
        raise TypeError(f"submit(fn=...) needs a callable training function, got {type(fn).__name__}.")
    check_restarts(max_restarts)
    check_progress(progress)
    given = None if run_dir is None else _given_run_dir(run_dir)
    if fn is sweep:
        check_timeout(timeout)
        check_stall(stall)
        if timeout is not None:  # submit's own timeout= meant the sweep's stop_after= before it had that name
            kwargs["stop_after"] = renamed_timeout(timeout, kwargs.get("stop_after"))
        unused = {"num_nodes": num_nodes != 1, "backend": backend is not None,
                  "launcher_options": bool(launcher_options), "trackers": trackers is not None,
                  "profile": profile is not None, "max_restarts": max_restarts != 0, "stall": stall is not None}
        name, kind = _sweep_name(args), "sweep"
        job, options = _sweep_job(args, kwargs, [key for key, set_ in unused.items() if set_], strategy=strategy,
                                  start=start, devices=devices, accelerator=accelerator, cluster=cluster)
        objects = ship_bytes({"cluster": None, "trackers": None, "profile": None})
        spec_name = f"sweep of {name[len('sweep-'):]}"
    else:
        refuse_foreign_keywords(fn, args, kwargs, "submit")
        launch_options = RunOptions(strategy, start, devices, accelerator, num_nodes, backend, timeout, stall,
                                    launcher_options, max_restarts)
        asked = launch_options.asked
        if cluster is None:  # bad settings fail here, before anything starts
            choose(asked, plan_devices(devices, accelerator, backend, num_nodes))
        else:
            check_cluster_words(asked, check_cluster(cluster))
            cluster.plan(devices, accelerator, backend, num_nodes)
        asked.say()
        name, kind = getattr(fn, "__name__", type(fn).__name__), "launch"
        spec_name = name
        # Pickled before any directory is made: a job that does not pickle leaves nothing behind.
        # The supervisor runs launch(..., cluster=...): the job survives the kernel. Trackers and
        # profiles write under the run directory.
        job = pack_job(fn, args, kwargs)
        objects = ship_bytes({"cluster": cluster, "trackers": check_trackers(trackers),
                              "profile": Profile.check(profile)})
        # In the new words (an earlier name was said here, once): the supervisor resolves 'auto' itself
        # and restarts the attempts (max_restarts is run.json's own, not the launch's).
        options = {key: value for key, value in launch_options.spec().items() if key != "max_restarts"}
    # ./nbtrain-runs is ours and no link (made 0700), as each run directory in it.
    base = private_dir(Path(RUNS).absolute()) if given is None else given.parent
    partial = runlog.partial_dir(base, name if given is None else given.name)
    made = None  # the empty directory new_run_dir took for the name, until the rename fills it
    try:
        runlog.write_whole(partial / runlog.JOB, job)
        runlog.write_whole(partial / runlog.OBJECTS, objects)
        runlog.write_spec(partial / runlog.SPEC, {"function": spec_name, "started": time.time(), "kind": kind,
                                                  "max_restarts": max_restarts, "launch": options})
        # Who submitted it: a run whose submitter died before its supervisor started reads failed.
        runlog.write_json(partial / runlog.STATUS, {"status": "queued", "restarts": [], "max_restarts": max_restarts,
                                                    "submitter": session.identity(os.getpid())})
        os.close(os.open(partial / runlog.SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        where = given or (made := runlog.new_run_dir(base, name))  # made empty at once, filled by the rename
        runlog.place(partial, where)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if made is not None and made.is_dir() and not any(made.iterdir()):
            made.rmdir()
        raise
    try:
        _start_supervisor(where, cluster, max_restarts)
    except BaseException as error:
        if not (where / runlog.SUPERVISOR).exists():  # a supervisor that never started: the run says why
            _never_started(where, error)
        raise
    return Run(where, progress)


def _sweep_name(args: tuple) -> str:
    fn = args[0] if args else None
    return f"sweep-{getattr(fn, '__name__', type(fn).__name__)}"


def _sweep_job(args: tuple, kwargs: dict, unused: list[str], **settings) -> tuple[bytes, dict]:
    """`submit(nbtrain.sweep, fn, space, trials=..., metric=...)`: the supervisor runs the sweep,
    its study SQLite in the run directory. The job is the sweep call, checked here as `sweep`
    checks it; submit's own settings that a sweep shares (devices, accelerator, strategy, start,
    cluster) are the sweep's. (job, the launch options run.json shows)."""
    if len(args) not in (1, 2):
        raise TypeError("submit(nbtrain.sweep, fn, space, trials=..., metric=...): give the trial function and its "
                        "space, or an Optuna objective(trial) alone, as to nbtrain.sweep (got "
                        f"{len(args)} positional arguments).")
    if unused:
        raise ValueError(f"{', '.join(unused)}= do not apply to a submitted sweep: give them to the trials' own code, "
                         "or submit a launch instead.")
    for key in ("run_dir", "progress"):  # taken by submit itself, never seen here; kept out of a sweep's own
        kwargs.pop(key, None)
    fn, space = (*args, None)[:2]
    check_sweep(fn, space, kwargs.get("trials"), kwargs.get("metric"), kwargs.get("direction"), kwargs.get("sampler"),
                kwargs.get("pruner"), kwargs.get("stop_after"), kwargs.get("catch", (Exception,)))
    if settings["cluster"] is None:
        plan_slots(settings["devices"], kwargs.get("devices_per_trial", 1), settings["accelerator"])
        slot_start(RunOptions(strategy=settings["strategy"], start=settings["start"]))
    job = pack_job(sweep, args, {**kwargs, **settings})
    options = {"strategy": settings["strategy"], "start": settings["start"], "devices": settings["devices"],
               "accelerator": settings["accelerator"], "num_nodes": 1, "backend": None, "timeout": None,
               "launcher_options": None}
    return job, options


def _start_supervisor(where: Path, cluster, max_restarts: int) -> None:
    # The kernel's import path, as the warm template gets it: the job's functions may come from
    # modules that only it can import (its directory, a sys.path.append).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
           **(cluster.supervisor_environ() if cluster is not None else {})}
    supervise = [sys.executable, "-P", "-c", _SUPERVISE, str(where)]
    if isinstance(cluster, Slurm):
        runlog.write_json(where / runlog.SUPERVISOR, _supervisor_job(where, cluster, supervise, env, max_restarts))
        return
    warm = _ready_template()
    if warm is not None:
        # A fork of the kernel's warm template, which has imported torch: the supervisor starts
        # in milliseconds instead of a fresh interpreter's second or more (benchmarks/submit_latency.py).
        warm.detach(env, "nbtrain.notebook.detached.supervise:main", [str(where)], str(where / runlog.SUPERVISOR_LOG),
                    str(where / runlog.SUPERVISOR))
    else:
        subprocess.run([sys.executable, "-c", _DETACH, str(where / runlog.SUPERVISOR_LOG),
                        str(where / runlog.SUPERVISOR), *supervise], capture_output=True, text=True, check=True,
                       env=env)


def _ready_template():
    """The kernel's warm template if it is ready and answering, else None. A template still starting
    (the kernel's first submit: 3-5 s of importing torch) is not waited for: this run's supervisor
    starts as a fresh interpreter, which imports torch on its own time, and the template, started
    now in the background, serves the next submits and CUDA-safe launches."""
    running = template(start=False)
    if running is None or running.pid is None:  # none, or not ready yet
        warm_in_background()
        return None
    try:
        return template()  # answering? (a stopped or hung one is noticed in seconds)
    except RuntimeError:  # it stopped answering: a fresh interpreter
        return None


def _never_started(where: Path, error: BaseException) -> None:
    """submit stopped before the supervisor started: status.json says so (a supervisor that
    starts after all finds the run ended, and leaves it)."""
    reason = "submit was interrupted before the run's supervisor started" if isinstance(error, KeyboardInterrupt) \
        else f"the run's supervisor could not be started: {error}"
    try:
        status = runlog.read_json(where / runlog.STATUS)
        status.update(status="failed", reason=reason, ended=time.time())
        runlog.write_json(where / runlog.STATUS, status)
    except (OSError, ValueError):
        pass


def _supervisor_job(where: Path, cluster, supervise: list[str], env: dict, max_restarts: int) -> dict:
    """With SLURM the supervisor is a batch job of its own (one CPU, the cluster's partition and
    account): nothing of the run is left on this machine, so it outlives the login node's or
    the notebook server's session too. It submits the ranks' job from there."""
    command = ["sbatch", "--parsable", f"--job-name=nbtrain-run-{where.name}", "--ntasks=1", "--cpus-per-task=1",
               f"--output={where / runlog.SUPERVISOR_LOG}", f"--chdir={os.getcwd()}", "--export=ALL"]
    command += [f"--partition={cluster.partition}"] if cluster.partition else []
    command += [f"--account={cluster.account}"] if cluster.account else []
    if type(cluster.time) is int:  # minutes per attempt, and time to wait for each attempt's job: twice
        command.append(f"--time={2 * cluster.time * (max_restarts + 1)}")
    submitted = subprocess.run([*command, "--wrap", shlex.join(supervise)], capture_output=True, text=True,
                               env={**env, "NBTRAIN_SUPERVISOR_JOB": "1"})
    if submitted.returncode != 0:
        raise RuntimeError(f"sbatch refused the run's supervisor job: {submitted.stderr.strip() or submitted.stdout}")
    return {"slurm_job": submitted.stdout.strip().split(";")[0]}


def _given_run_dir(run_dir) -> Path:
    """`run_dir` as an absolute path that is new, or an empty directory of ours; a link or
    another user's directory is refused before anything is written (its mode included)."""
    if not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir):
        raise TypeError(f"run_dir={run_dir!r}: give a directory path (str or Path), or None for a new one "
                        "under ./nbtrain-runs/.")
    path = Path(run_dir).absolute()
    if os.path.lexists(path):
        check_own(path, "run_dir")
        if not path.is_dir() or any(path.iterdir()):
            raise FileExistsError(f"run_dir={str(run_dir)!r} exists and is not empty; give a new or empty directory "
                                  "(or leave run_dir unset for a new one under ./nbtrain-runs/).")
    return path
