"""`nbtrain.sweep`: hyper-parameter trials packed onto the devices, on Optuna.

    best = nbtrain.sweep(objective, trials=20, devices=2)   # Optuna's objective(trial), unchanged
    space = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
    best = nbtrain.sweep(train, space, trials=20, metric="loss", devices=2)   # or fn(**params)
    best.best_params, best.best_value, best.best_result.value

Optuna decides everything a sweep decides: which parameters a trial gets (its sampler, enqueued
trials first), whether a trial is pruned (its pruner), where the study is kept (its storage: by
default SQLite in a run directory named by the objective, so running the same cell again after
an interruption resumes: `sweep_study.py`). nbtrain runs each trial on a free slot (`slots.py`)
with the slot's share of the cores (`rank/trial.py`): a call on the slot's warm process where the
trial has one device on this machine (`sweep_workers.py`), else a launch of its own. An
`objective(trial)` gets a trial whose every call the study here answers (`sweep_trials.py`); a
`fn(**params)` has its `ctx.log(metric, ...)` reported to the trial, and a pruned trial ends at
once, freeing its slot for the next.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...display.sweep_view import SweepState, make_view, summary_html, summary_text
from ..run.launch import check_cluster_words
from ..run.options import RunOptions
from ..run.result import Result
from .slots import SlotRunner, plan_slots, slot_start
from .sweep_run import SweepRun, device_memory, importances, objective
from .sweep_settings import check_sweep, cluster_slots, renamed_timeout, require_optuna
from .sweep_study import open_study, resume, study_name
from .sweep_trials import TrialServer
from .sweep_workers import TrialWorkers

__all__ = ["Sweep", "check_sweep", "device_memory", "objective", "renamed_timeout", "sweep"]

log = logging.getLogger(__name__)

# Each study's best trial's Result (its model) once it ran in this kernel: a sweep run again to
# resume or to add trials still has it when that trial stays the best. One per study.
_KEPT: dict[tuple, tuple[int, Result]] = {}


class Sweep:
    """What `sweep` returns: the Optuna study, its best trial, and the best trial's Result.

    Shown as a cell's value, the sweep's summary: a row per trial and the best.

    Parameters
    ----------
    study : optuna.Study
        The study the trials were told to.
    state : SweepState
        What the sweep's view drew.
    best : tuple of (int, Result), optional
        The best trial's number and Result, when it ran in this kernel.
    run_dir : str, optional
        Where the study is kept (its SQLite file), when nbtrain chose the storage.
    verdict : str, default 'finished'
        How the sweep ended ("ended with no complete trial (...)" when the study holds none).

    Attributes
    ----------
    study : optuna.Study
    run_dir : str or None
    verdict : str
    """

    def __init__(self, study, state: SweepState, best: tuple[int, Result] | None, run_dir: str | None,
                 verdict: str = "finished"):
        self.study, self.state, self.run_dir, self.verdict = study, state, run_dir, verdict
        self._best = best  # (trial number, its Result)

    @property
    def metric(self) -> str:
        """The metric the trials were judged by."""
        return self.state.metric

    @property
    def best_trial(self):
        """Optuna's best trial (a ``FrozenTrial``); raises ValueError, saying why, while no trial is complete."""
        if not self.study.get_trials(deepcopy=False, states=(_complete(),)):
            raise ValueError(f"no trial of the study {self.study.study_name!r} is complete ({self.verdict}): "
                             "it has no best trial, value or parameters yet.")
        return self.study.best_trial

    @property
    def best_params(self) -> dict:
        """The best trial's parameters (those it used: a define-by-run trial's own)."""
        return self.best_trial.params

    @property
    def best_value(self) -> float:
        """The best trial's value."""
        return self.best_trial.value

    @property
    def best_result(self) -> Result | None:
        """The best trial's `Result` (its ``value`` is what ``fn`` returned: the trained model),
        kept when that trial ran in this kernel (in this sweep or an earlier one of the same
        study); None when it ran in an earlier session, or no trial is complete."""
        if self._best is None or not self.study.get_trials(deepcopy=False, states=(_complete(),)):
            return None
        if self._best[0] != self.study.best_trial.number:
            return None
        return self._best[1]

    def dataframe(self, **kwargs):
        """Every trial as a pandas DataFrame (Optuna's ``trials_dataframe``; needs pandas).

        Parameters
        ----------
        **kwargs
            Optuna's ``trials_dataframe`` options (``attrs=``, ``multi_index=``).

        Returns
        -------
        pandas.DataFrame
        """
        return self.study.trials_dataframe(**kwargs)

    def _repr_html_(self) -> str:
        return summary_html(self.state, self.verdict)

    def __repr__(self) -> str:
        return summary_text(self.state, self.verdict)



def _complete():
    return require_optuna().trial.TrialState.COMPLETE


def sweep(fn, space: dict | None = None, *, trials: int, metric: str | None = None, devices="auto",
          devices_per_trial: int = 1, trials_per_device: int = 1,
          direction: str | None = None, sampler=None, pruner=None, study=None, stop_after: float | None = None,
          catch=(Exception,), run_dir=None, progress=True, accelerator: str = "auto", strategy: str = "auto",
          start: str = "auto", cluster=None, timeout: float | None = None) -> Sweep:
    """Hyper-parameter trials of Optuna's ``objective(trial)``, or of ``fn(**params)``, packed onto
    the devices, run on Optuna.

    Each trial runs on a free slot of ``devices_per_trial`` devices (a call on the slot's one
    warm process on one device, or a normal launch on several), with the slot's share of the
    cores. ``fn(trial)`` gets a trial that the study in the notebook answers (``suggest_*``,
    ``report``, ``should_prune``, ``set_user_attr``, ``params``): its value is what it returns,
    and raising ``optuna.TrialPruned`` prunes it, as under ``study.optimize``. ``fn(**params)``
    with a ``space`` reports ``ctx.log(metric, value, step=)`` to the trial, and a trial Optuna's
    pruner stops ends at once, freeing its slot; its value is the last ``metric`` it logged (or
    what ``fn`` returned, if a number). One live view shows a row per trial; Ctrl-C stops every
    trial, leaving nothing, and running the cell again resumes the study.

    Parameters
    ----------
    fn : callable
        ``objective(trial)``, as Optuna calls it; or, with ``space``, a function taking the
        parameters as keyword arguments.
    space : dict, optional
        Parameter names mapped to Optuna distributions:
        ``{"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}``. With a
        function that takes a trial, parameters it is given up front.
    trials : int
        How many finished trials the study should hold when the sweep ends; those it holds
        already count (so a resumed sweep runs the rest; interrupted trials run again first).
    metric : str, optional
        The name ``fn`` logs with ``ctx.log`` that judges a trial; required with ``fn(**params)``.
    devices : int, str or list, default 'auto'
        As for `launch`: every visible GPU, or on CPU a number of CPU processes. With
        ``cluster``, how many devices the sweep holds at once.
    devices_per_trial : int, default 1
        Devices (ranks) per trial.
    trials_per_device : int, default 1
        Trials that share each GPU at once (small models that leave most of a GPU idle; their
        memory together must fit). GPUs only, with ``devices_per_trial=1``.
    direction : {'minimize', 'maximize'}, optional
        Default the study's (minimize for a new one).
    sampler : optuna.samplers.BaseSampler, optional
        Which parameters a trial gets; default the study's (TPE).
    pruner : optuna.pruners.BasePruner, optional
        Whether a trial is stopped early; default the study's (MedianPruner).
    study : optuna.Study or str, optional
        A study to continue (its enqueued trials first), or a storage URL; default a SQLite
        study in ``run_dir``.
    stop_after : float, optional
        Seconds after which no new trial starts; the running ones finish (what Optuna's
        ``study.optimize(timeout=)`` does).
    catch : exception class or tuple, default (Exception,)
        A trial raising one of these is recorded as failed (traceback in its user attributes)
        and the sweep goes on; ``()`` stops at the first failure.
    run_dir : str or Path, optional
        Where the default study is kept; default ./nbtrain-runs/sweep-<fn>-<key>/, private to
        you, its key made from fn's code and the space: another objective never resumes it.
    progress : bool or str, default True
        As for `launch`.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        As for `launch`.
    strategy : {'auto', 'ddp', 'fsdp'}, default 'auto'
        How ``ctx.setup`` wraps a model in a trial of several devices ('auto': DDP).
    start : {'auto', 'template', 'spawn', 'torchrun'}, default 'auto'
        Where a trial's ranks come from; 'auto': the warm template ('fsdp': torchrun). A fork of
        this kernel is refused: trials start from threads, where a fork can hang on a lock.
    cluster : Slurm or Ray, optional
        Each trial a job or actors there.
    timeout : float, optional
        The earlier name of ``stop_after`` (until nbtrain 0.3; a DeprecationWarning says so).

    Returns
    -------
    Sweep
        The study, the best trial's parameters and value, and its `Result` when it ran here
        (read its attributes; the class is not a public name to test with ``isinstance``).

    Raises
    ------
    ImportError
        Optuna is not installed (``pip install 'nbtrain[sweep]'``).
    ValueError
        A setting is not accepted, or a trial logged no ``metric`` and returned no number.
    TypeError
        ``fn`` is not callable.
    WorkerError
        A trial failed with an error not in ``catch``, or every trial of the sweep failed (the
        first trial's error).
    RuntimeError
        Another sweep of the same study is running (in another kernel), or the study cannot be
        written (a full disk).
    KeyboardInterrupt
        Ctrl-C: every running trial was stopped; the finished ones are kept in the study.
    """
    optuna = require_optuna()
    stop_after = renamed_timeout(timeout, stop_after)
    space, catch, with_trial = check_sweep(fn, space, trials, metric, direction, sampler, pruner, stop_after, catch)
    view = make_view(progress)
    options = RunOptions(strategy=strategy, start=start, devices=devices, accelerator=accelerator)  # checked once
    if cluster is None:
        slots, idle = plan_slots(options.devices, devices_per_trial, options.accelerator, per_device=trials_per_device)
        strategy, start = slot_start(options)
    else:
        check_cluster_words(options.asked, cluster)  # refused here, not by every trial
        if trials_per_device != 1:
            raise ValueError(f"trials_per_device={trials_per_device!r} with cluster=: the cluster places each trial; "
                             "give devices= (how many devices the sweep holds at once) instead.")
        if with_trial:  # its trials would dial the notebook's loopback-only trial channel
            raise ValueError(f"sweep({study_name(fn)}) with cluster=: a trial on a cluster cannot yet ask the study "
                             "in this notebook; give space= (Optuna distributions) and a fn(**params) that reports "
                             "with ctx.log, or run the objective on this machine's devices.")
        slots, idle = cluster_slots(options.devices, devices_per_trial, options.accelerator), None
    given = study
    opened = open_study(optuna, study, fn, space=space, direction=direction, sampler=sampler, pruner=pruner,
                        metric=metric, run_dir=run_dir)
    study, run_dir = opened.study, opened.run_dir
    server = None
    stopped: Callable[[], None] = lambda: None  # noqa: E731
    try:
        kept_as = (run_dir if run_dir else given if isinstance(given, str) else id(given), study.study_name)
        done = resume(optuna, study)
        kind = "GPU" if slots[0].accelerator == "gpu" else "CPU" if cluster is None else cluster.engine
        where = f"{len(slots)} {kind} slot{'s' if len(slots) > 1 else ''}" + (
            f" of {devices_per_trial}" if devices_per_trial > 1 else "") + (
            f", {trials_per_device} per GPU" if trials_per_device > 1 else "")
        state = SweepState(f"sweep of {study_name(fn)}", metric or "value", study.direction.name.lower(), where,
                           trials, done)
        run = SweepRun(optuna, study, fn, space, metric, catch, trials - done,
                        None if stop_after is None else time.monotonic() + stop_after, strategy, start, cluster, state,
                        view)
        server = run.server = TrialServer(run.lock) if with_trial else None
        run.note_best()
        run.best = _KEPT.get(kept_as)  # a best trial an earlier sweep of this study ran in this kernel
        if opened.said:
            view.output(opened.said)
        view.start(state)
        if idle:
            view.output(f"nbtrain: {idle}")
        if done >= trials:
            view.output(f"nbtrain: the study already holds {done} finished trials (trials={trials}): nothing to run. "
                        "Raise trials= to run more"
                        + (f", or give another run_dir for a new sweep ({run_dir})." if run_dir else "."))
        run.runner = SlotRunner(slots, run.work, warm=cluster is None, preload=("optuna",) if with_trial else ())
        if cluster is None and start == "template":  # one-device trials are calls on a live rank per slot
            run.workers = TrialWorkers(strategy)
        verdict = "finished"
        try:
            try:
                if done < trials:
                    run.runner.run(run.tick)
            finally:
                if run.workers is not None:
                    stopped = run.workers.closing()
            verdict = run.verdict()
        except KeyboardInterrupt as interrupt:
            verdict = "interrupted"
            kept = f" in {run_dir}" if run_dir else ""
            interrupt._render_traceback_ = lambda: [  # type: ignore[attr-defined]  # IPython's hook
                "KeyboardInterrupt: the sweep was interrupted; nbtrain stopped every running trial. The finished "
                f"trials are kept in the study{kept}: run the cell again to resume."]
            raise
        except BaseException:
            verdict = "failed"
            raise
        finally:
            state.ended = time.monotonic()
            if verdict == "finished":
                state.importances = importances(optuna, study)
            if run.alike:
                run.lines.append((f"nbtrain: {run.alike} line{'s' if run.alike > 1 else ''} that trials wrote to "
                                  "stderr as an earlier trial had (a library's banner, a warning) shown once",
                                  "stdout"))
            run.tick()
            view.finish(state, verdict)
            if run.best is not None:
                _KEPT[kept_as] = run.best
    finally:
        stopped()  # the warm processes, stopping while the summary was drawn: gone before the sweep returns
        if server is not None:
            server.close()
        opened.close()
    if verdict.startswith("failed"):  # every trial failed: the first one's error, as the sweep's
        raise run.failures[0]
    return Sweep(study, state, run.best, run_dir, verdict)

