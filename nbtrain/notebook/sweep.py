"""`nbtrain.sweep`: hyper-parameter trials packed onto the devices, on Optuna.

    space = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}
    best = nbtrain.sweep(train, space, trials=20, metric="loss", devices=2)   # a Sweep
    best.best_params, best.best_value, best.best_result.value

Optuna decides everything a sweep decides: which parameters a trial gets (its sampler, enqueued
trials first), whether a trial is pruned (its pruner, asked each time the trial logs the metric),
where the study is kept (its storage: by default SQLite in the sweep's run directory, so running
the same cell again after an interruption resumes: `sweep_study.py`). nbtrain runs each trial as a launch of
`fn(**params)` on a free slot (`slots.py`), reports `ctx.log(metric, ...)` to the trial, and ends
a pruned trial's launch at once, freeing its slot for the next.
"""
from __future__ import annotations

import functools
import numbers
import threading
import time
from collections import deque

from ..common.errors import WorkerError
from ..common.tracebacks import name_cells
from ..display.sweep_view import SweepState, TrialRow, make_view, summary_html, summary_text
from .choices import words
from .insight import _name
from .launch import check_cluster_words, check_timeout, launch
from .restarts import why
from .result import Result
from .slots import Slot, SlotRunner, check_count, plan_slots, slot_start
from .sweep_study import ERROR, INTERRUPTED, KERNEL, SLOT, TRACEBACK, TRACEBACK_CHARS, open_study, resume, this_kernel

OPTUNA_MISSING = "nbtrain.sweep runs on Optuna, which is not installed: pip install 'nbtrain[sweep]' (or optuna)."
DIRECTIONS = ("minimize", "maximize")
# Each study's best trial's Result (its model) once it ran in this kernel: a sweep run again to
# resume or to add trials still has it when that trial stays the best. One per study.
_KEPT: dict[tuple, tuple[int, Result]] = {}


def _optuna():
    try:
        import optuna
    except ImportError as exc:
        raise ImportError(OPTUNA_MISSING) from exc
    return optuna


class _Pruned(Exception):
    """Raised in a trial's display when Optuna's pruner says stop: its launch ends at once."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


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

    Attributes
    ----------
    study : optuna.Study
    run_dir : str or None
    """

    def __init__(self, study, state: SweepState, best: tuple[int, Result] | None, run_dir: str | None):
        self.study, self.state, self.run_dir = study, state, run_dir
        self._best = best  # (trial number, its Result)

    @property
    def metric(self) -> str:
        """The metric the trials were judged by."""
        return self.state.metric

    @property
    def best_trial(self):
        """Optuna's best trial (a ``FrozenTrial``); raises ValueError while no trial is complete."""
        return self.study.best_trial

    @property
    def best_params(self) -> dict:
        """The best trial's parameters."""
        return self.study.best_params

    @property
    def best_value(self) -> float:
        """The best trial's value."""
        return self.study.best_value

    @property
    def best_result(self) -> Result | None:
        """The best trial's `Result` (its ``value`` is what ``fn`` returned: the trained model),
        kept when that trial ran in this kernel (in this sweep or an earlier one of the same
        study); None when it ran in an earlier session."""
        if self._best is None or self._best[0] != self.study.best_trial.number:
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
        return summary_html(self.state, "finished")

    def __repr__(self) -> str:
        return summary_text(self.state, "finished")


def check_space(space, optuna) -> dict:
    example = "e.g. {'lr': optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}"
    if not isinstance(space, dict) or not space:
        raise ValueError(f"space={space!r}: give a dict mapping parameter names to Optuna distributions, {example}.")
    for name, distribution in space.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"space key {name!r}: a parameter name is passed as fn's keyword, "
                             "so it must be an identifier.")
        if not isinstance(distribution, optuna.distributions.BaseDistribution):
            raise ValueError(f"space[{name!r}]={distribution!r}: give an Optuna distribution (FloatDistribution, "
                             f"IntDistribution, CategoricalDistribution), {example}.")
    return dict(space)


def check_catch(catch) -> tuple:
    given, catch = catch, catch if isinstance(catch, tuple) else (catch,)
    if not all(isinstance(c, type) and issubclass(c, BaseException) for c in catch):
        raise ValueError(f"catch={given!r}: give an exception class or a tuple of them (a trial raising one is "
                         "recorded as failed and the sweep goes on), or () to stop at the first failure.")
    return catch


def objective(result: Result, metric: str) -> float | None:
    """The trial's value: the last `metric` rank 0 logged, else what fn returned if it is a number."""
    logged = result.metrics(metric, rank=0)
    if logged:
        return logged[-1]
    value = result.value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def bar_text(view) -> str:
    levels = sorted(view.bars.items())
    return " ".join(f"{b.desc} {b.n}/{b.total}" if b.total is not None else f"{b.desc} {b.n}" for _, b in levels)


class _Reporter:
    """One trial's metric, as its launch reports it: to the row, to Optuna, and Optuna's pruner asked."""

    def __init__(self, run: _SweepRun, trial, row: TrialRow):
        self.run, self.trial, self.row = run, trial, row
        self.read = 0
        self.reported: set[int] = set()

    def update(self, state, final: bool) -> None:
        new, self.read = state.history[self.read:], len(state.history)
        first = min(state.ranks)
        fresh = [m for m in new if m.name == self.run.metric and m.rank == first]
        for m in fresh:
            self.row.curve.add(m.step, m.value)
            self.row.value, self.row.step = m.value, m.step
        view = state.ranks.get(first)
        progress = bar_text(view) if view is not None else ""
        if fresh or progress != self.row.progress:
            self.row.progress = progress
            self.run.changed()
        for m in fresh:
            if m.step not in self.reported:
                self.reported.add(m.step)
                self.trial.report(m.value, m.step)
        if fresh and not final and self.trial.should_prune():
            raise _Pruned(fresh[-1].step)


class _SweepRun:
    """One call of `sweep`: the study, the slots' work, the state the view draws."""

    def __init__(self, optuna, study, fn, space, metric, catch, remaining: int, deadline, strategy, start,
                 cluster, state: SweepState, view):
        self.optuna, self.study, self.fn, self.space, self.metric = optuna, study, fn, space, metric
        self.catch, self.remaining, self.deadline = catch, remaining, deadline
        self.strategy, self.start, self.cluster = strategy, start, cluster
        self.state, self.view = state, view
        self.started = 0
        self.best: tuple[int, Result] | None = None
        self.lines: deque[tuple[str, str]] = deque()  # (text, stream): the trials' output, for the main thread
        self.runner: SlotRunner | None = None
        self._lock = threading.Lock()

    def changed(self) -> None:
        self.state.version += 1

    def tick(self) -> None:
        """On the main thread: what the trials printed, then the view (drawn from here only)."""
        while self.lines:
            self.view.output(*self.lines.popleft())
        self.view.update(self.state)

    def _say(self, number: int, rank, stream: str, text: str) -> None:
        self.lines.append((f"[trial {number}] {text}" if not rank else f"[trial {number} rank {rank}] {text}", stream))

    def _note(self, number: int, text: str) -> None:
        self.lines.append((f"nbtrain: trial {number}: {text}", "stdout"))

    def _next(self):
        with self._lock:
            if self.started >= self.remaining or (self.deadline is not None and time.monotonic() > self.deadline):
                return None
            self.started += 1
            return self.study.ask(self.space)

    def work(self, slot: Slot) -> bool:
        trial = self._next()
        if trial is None:
            return False
        TrialState = self.optuna.trial.TrialState
        trial.set_user_attr(KERNEL, this_kernel())
        trial.set_user_attr(SLOT, str(slot))
        row = TrialRow(trial.number, dict(trial.params), str(slot))
        self.state.add(row)
        reporter, display = _Reporter(self, trial, row), None
        assert self.runner is not None, "trials run after the slots started"
        try:
            display = self.runner.display(on_update=reporter.update,
                                          on_output=functools.partial(self._say, trial.number),
                                          on_note=functools.partial(self._note, trial.number))
            result = launch(functools.partial(self.fn, **trial.params), devices=slot.launch_devices,
                            accelerator=slot.accelerator, strategy=self.strategy, start=self.start,
                            cluster=self.cluster, progress=display)
        except _Pruned as pruned:
            self._end(trial, row, "pruned", f"pruned at step {pruned.step}", TrialState.PRUNED)
            return True
        except KeyboardInterrupt:
            trial.set_user_attr(INTERRUPTED, True)
            self._end(trial, row, "interrupted", "stopped by Ctrl-C (resumed: run again)", TrialState.FAIL)
            raise
        except WorkerError as error:
            trial.set_user_attr(ERROR, why(error))
            trial.set_user_attr(TRACEBACK, name_cells(error.traceback)[-TRACEBACK_CHARS:])  # In[3], not a temp file
            self._end(trial, row, "failed", why(error), TrialState.FAIL)
            if not isinstance(error, self.catch):
                raise
            return True
        except BaseException as error:  # refused in the notebook (cannot be sent, bad settings): so would the rest be
            self._end(trial, row, "failed", f"{type(error).__name__}: {error}".splitlines()[0], TrialState.FAIL)
            raise
        finally:
            if display is not None:
                display.release()
        value = objective(result, self.metric)
        if value is None:
            self._end(trial, row, "failed", f"logged no {self.metric!r}", TrialState.FAIL)
            raise ValueError(f"trial {trial.number} logged no {self.metric!r} (ctx.log({self.metric!r}, value)) and "
                             f"returned no number: the sweep needs one of them as the trial's value.")
        with self._lock:
            told = self.study.tell(trial, value)
            row.value = value
            if told.state != TrialState.COMPLETE:  # Optuna refuses nan: the trial failed
                self._finish_row(row, "failed", f"its value, {value!r}, is not one Optuna accepts")
                return True
            self._finish_row(row, "complete", "")
            best = self._best()
            if best is not None and best[0] == trial.number:
                self.best = (trial.number, result)  # the model of the best trial so far; earlier ones are let go
        return True

    def _end(self, trial, row: TrialRow, state: str, detail: str, optuna_state) -> None:
        with self._lock:
            self.study.tell(trial, state=optuna_state, skip_if_finished=True)
            self._finish_row(row, state, detail)

    def _finish_row(self, row: TrialRow, state: str, detail: str) -> None:
        row.state, row.detail, row.ended = state, detail, time.monotonic()
        self._best()
        self.changed()

    def _best(self):
        try:
            best = self.study.best_trial
        except ValueError:  # no trial complete yet
            return None
        self.state.best = (best.number, best.value, dict(best.params))
        return self.state.best


def sweep(fn, space: dict, *, trials: int, metric: str, devices="auto", devices_per_trial: int = 1,
          direction: str | None = None, sampler=None, pruner=None, study=None, timeout: float | None = None,
          catch=(Exception,), run_dir=None, progress=True, accelerator: str = "auto", strategy: str = "auto",
          start: str = "auto", cluster=None) -> Sweep:
    """Hyper-parameter trials of ``fn(**params)``, packed onto the devices, run on Optuna.

    Each trial is a launch on a free slot of ``devices_per_trial`` devices (one process on one
    device, or a normal launch on several); inside ``fn``, ``ctx.log(metric, value, step=)``
    reports to the trial, and Optuna's pruner may stop it, freeing the slot at once. A trial's
    value is the last ``metric`` it logged (or what ``fn`` returned, if a number). One live view
    shows a row per trial; Ctrl-C stops every trial, leaving nothing, and running the cell again
    resumes the study.

    Parameters
    ----------
    fn : callable
        The trial function; it takes the parameters as keyword arguments.
    space : dict
        Parameter names mapped to Optuna distributions:
        ``{"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)}``.
    trials : int
        How many finished trials the study should hold when the sweep ends; those it holds
        already count (so a resumed sweep runs the rest; interrupted trials run again first).
    metric : str
        The name ``fn`` logs with ``ctx.log`` that judges a trial.
    devices : int, str or list, default 'auto'
        As for `launch`: every visible GPU, or on CPU a number of CPU processes. With
        ``cluster``, how many devices the sweep holds at once.
    devices_per_trial : int, default 1
        Devices (ranks) per trial.
    direction : {'minimize', 'maximize'}, optional
        Default the study's (minimize for a new one).
    sampler : optuna.samplers.BaseSampler, optional
        Which parameters a trial gets; default the study's (TPE).
    pruner : optuna.pruners.BasePruner, optional
        Whether a trial is stopped early; default the study's (MedianPruner).
    study : optuna.Study or str, optional
        A study to continue (its enqueued trials first), or a storage URL; default a SQLite
        study in ``run_dir``.
    timeout : float, optional
        Seconds after which no new trial starts.
    catch : exception class or tuple, default (Exception,)
        A trial raising one of these is recorded as failed (traceback in its user attributes)
        and the sweep goes on; ``()`` stops at the first failure.
    run_dir : str or Path, optional
        Where the default study is kept; default ./nbtrain-runs/sweep-<fn>/, private to you.
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
        A trial failed with an error not in ``catch``.
    KeyboardInterrupt
        Ctrl-C: every running trial was stopped; the finished ones are kept in the study.
    """
    optuna = _optuna()
    space, catch = check_sweep(fn, space, trials, metric, direction, sampler, pruner, timeout, catch)
    view = make_view(progress)
    if cluster is None:
        slots, idle = plan_slots(devices, devices_per_trial, accelerator)
        strategy, start = slot_start(strategy, start)
    else:
        check_cluster_words(words(strategy, start), cluster)  # refused here, not by every trial
        slots, idle = cluster_slots(devices, devices_per_trial, accelerator), None
    given = study
    study, run_dir = open_study(optuna, study, fn, direction=direction, sampler=sampler, pruner=pruner, metric=metric,
                                run_dir=run_dir)
    kept_as = (run_dir if run_dir else given if isinstance(given, str) else id(given), study.study_name)
    done = resume(optuna, study)
    kind = "GPU" if slots[0].accelerator == "gpu" else "CPU" if cluster is None else cluster.engine
    where = f"{len(slots)} {kind} slot{'s' if len(slots) > 1 else ''}" + (
        f" of {devices_per_trial}" if devices_per_trial > 1 else "")
    state = SweepState(f"sweep of {_name(fn)}", metric, study.direction.name.lower(), where, trials, done)
    run = _SweepRun(optuna, study, fn, space, metric, catch, trials - done,
                    None if timeout is None else time.monotonic() + timeout, strategy, start, cluster, state, view)
    run._best()
    run.best = _KEPT.get(kept_as)  # a best trial an earlier sweep of this study ran in this kernel
    view.start(state)
    if idle:
        view.output(f"nbtrain: {idle}")
    if done >= trials:
        view.output(f"nbtrain: the study already holds {done} finished trials (trials={trials}): nothing to run. "
                    "Raise trials= to run more"
                    + (f", or give another run_dir for a new sweep ({run_dir})." if run_dir else "."))
    run.runner = SlotRunner(slots, run.work, warm=cluster is None)
    verdict = "finished"
    try:
        if done < trials:
            run.runner.run(run.tick)
    except KeyboardInterrupt as interrupt:
        verdict = "interrupted"
        kept = f" in {run_dir}" if run_dir else ""
        interrupt._render_traceback_ = lambda: [  # type: ignore[attr-defined]  # IPython's hook
            "KeyboardInterrupt: the sweep was interrupted; nbtrain stopped every running trial. The finished trials "
            f"are kept in the study{kept}: run the cell again to resume."]
        raise
    except BaseException:
        verdict = "failed"
        raise
    finally:
        state.ended = time.monotonic()
        run.tick()
        view.finish(state, verdict)
        if run.best is not None:
            _KEPT[kept_as] = run.best
    return Sweep(study, state, run.best, run_dir)


def check_sweep(fn, space, trials, metric, direction, sampler, pruner, timeout, catch) -> tuple[dict, tuple]:
    """The sweep's settings checked, each refused in one line: (space, catch) as the sweep uses them.
    `submit(sweep, ...)` checks them too, before anything is written."""
    optuna = _optuna()
    if not callable(fn):
        raise TypeError(f"sweep(fn=...) needs a callable trial function, got {type(fn).__name__}.")
    space = check_space(space, optuna)
    check_count(trials, "trials")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r}: give the name fn logs with ctx.log(name, value), e.g. metric='loss'.")
    if direction is not None and direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: give 'minimize' or 'maximize'.")
    if sampler is not None and not isinstance(sampler, optuna.samplers.BaseSampler):
        raise ValueError(f"sampler={sampler!r}: give an Optuna sampler (optuna.samplers.TPESampler(), ...) or None.")
    if pruner is not None and not isinstance(pruner, optuna.pruners.BasePruner):
        raise ValueError(f"pruner={pruner!r}: give an Optuna pruner (optuna.pruners.MedianPruner(), ...) or None.")
    check_timeout(timeout)
    return space, check_catch(catch)


def cluster_slots(devices, per_slot: int, accelerator: str) -> list[Slot]:
    """On a cluster, `devices` is how many devices the sweep may hold at once: slots of `per_slot`."""
    check_count(per_slot, "devices_per_trial")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < per_slot:
        raise ValueError(f"devices={devices!r} with cluster=: give how many devices the sweep may hold at once on the "
                         f"cluster, an int >= devices_per_trial ({per_slot}).")
    return [Slot(i, accelerator, (), per_slot) for i in range(devices // per_slot)]
