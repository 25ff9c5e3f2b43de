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

import functools
import inspect
import logging
import math
import numbers
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable

from ...common.errors import WorkerError
from ...common.tracebacks import name_cells
from ...display.sweep_view import SweepState, TrialRow, make_view, summary_html, summary_text
from ...rank.trial import PRUNED, TrialSpec, run_trial
from ..run.choices import words
from ..run.insight import function_name
from ..run.launch import check_cluster_words, launch
from ..run.options import check_count
from ..run.restarts import why
from ..run.result import Result
from .slots import Slot, SlotRunner, plan_slots, slot_start
from .sweep_study import (
    ERROR,
    GPU_MEMORY,
    INTERRUPTED,
    KERNEL,
    SLOT,
    TRACEBACK,
    TRACEBACK_CHARS,
    open_study,
    resume,
    study_name,
    this_kernel,
)
from .sweep_trials import TrialServer
from .sweep_workers import TrialWorkers

log = logging.getLogger(__name__)

OPTUNA_MISSING = "nbtrain.sweep runs on Optuna, which is not installed: pip install 'nbtrain[sweep]' (or optuna)."
DIRECTIONS = ("minimize", "maximize")
IMPORTANCE_TRIALS = 2000  # beyond this, the evaluator's seconds are not spent on a summary
SAID_LINES = 10_000  # stderr lines remembered, to show a library's banner once per sweep rather than per trial
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
    return _optuna().trial.TrialState.COMPLETE


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


def objective(result: Result, metric: str | None, returned_first: bool = False) -> float | None:
    """The trial's value: the last `metric` rank 0 logged, else what fn returned if it is a number;
    `returned_first` (fn(trial), as Optuna's objectives): what fn returned, else the metric."""
    value = result.value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    returned = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    logged = result.metrics(metric, rank=0) if metric else []
    if returned_first and returned is not None:
        return returned
    return logged[-1] if logged else returned


def bar_text(view) -> str:
    levels = sorted(view.bars.items())
    return " ".join(f"{b.desc} {b.n}/{b.total}" if b.total is not None else f"{b.desc} {b.n}" for _, b in levels)


class _Reporter:
    """One trial's progress, as its launch reports it: to the row, and (fn(**params) trials) its
    `metric` to Optuna, whose pruner is asked. A fn(trial) trial reports itself (`heard`)."""

    def __init__(self, run: _SweepRun, trial, row: TrialRow, reports: bool):
        self.run, self.trial, self.row, self.reports = run, trial, row, reports
        self.read = 0
        self.reported: set[int] = set()
        self.pruned: _Pruned | None = None  # the pruner stopped it (a warm worker's call: by an interrupt)

    def heard(self, method: str, args: tuple, value) -> None:
        """A fn(trial) trial's call, answered: its parameters and reports go to its row."""
        if method.startswith("suggest_"):
            self.row.params = {**self.row.params, args[0]: value}
        elif method == "report" and len(args) == 2:
            self.row.curve.add(args[1], args[0])
            self.row.value, self.row.step = args[0], args[1]
        else:
            return
        self.run.changed()

    def update(self, state, final: bool) -> None:
        new, self.read = state.history[self.read:], len(state.history)
        first = min(state.ranks)
        fresh = [m for m in new if m.name == self.run.metric and m.rank == first] if self.reports else []
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
                with self.run.lock:
                    self.trial.report(m.value, m.step)
        if fresh and not final:
            with self.run.lock:
                prune = self.trial.should_prune()
            if prune:
                raise _Pruned(fresh[-1].step)


class _SweepRun:
    """One call of `sweep`: the study, the slots' work, the state the view draws."""

    def __init__(self, optuna, study, fn, space, metric, catch, remaining: int, deadline, strategy, start,
                 cluster, state: SweepState, view, server: TrialServer | None = None):
        self.optuna, self.study, self.fn, self.space, self.metric = optuna, study, fn, space, metric
        self.catch, self.remaining, self.deadline = catch, remaining, deadline
        self.strategy, self.start, self.cluster = strategy, start, cluster
        self.state, self.view, self.server = state, view, server
        self.started = 0
        self.best: tuple[int, Result] | None = None
        self.failures: list[BaseException] = []  # the trials' errors that `catch` let the sweep go on after
        self.lines: deque[tuple[str, str]] = deque()  # (text, stream): the trials' output, for the main thread
        self.said: dict[str, int] = {}  # a stderr line a trial wrote: the first trial that wrote it
        self.alike = 0  # stderr lines left out: an earlier trial wrote each of them
        self.runner: SlotRunner | None = None
        self.workers: TrialWorkers | None = None  # each one-device slot's live rank, where trials run on this machine
        self.lock = threading.Lock()  # the study is told from the slots' threads and the trial server's

    def changed(self) -> None:
        self.state.version += 1

    def tick(self) -> None:
        """On the main thread: what the trials printed, then the view (drawn from here only)."""
        while self.lines:
            self.view.output(*self.lines.popleft())
        self.view.update(self.state)

    def _say(self, number: int, rank, stream: str, text: str) -> None:
        if stream == "stderr":  # a library's banner or warning, alike in every trial: shown for the first only
            said = self.said.get(text)
            if said is not None and said != number:
                self.alike += 1
                return
            if len(self.said) < SAID_LINES:
                self.said[text] = number
        self.lines.append((f"[trial {number}] {text}" if not rank else f"[trial {number} rank {rank}] {text}", stream))

    def _note(self, number: int, text: str) -> None:
        self.lines.append((f"nbtrain: trial {number}: {text}", "stdout"))

    def _next(self):
        with self.lock:
            if self.started >= self.remaining or (self.deadline is not None and time.monotonic() > self.deadline):
                return None
            self.started += 1
            trial = self.study.ask(self.space)
            trial.set_user_attr(KERNEL, this_kernel())
            return trial

    def _spec(self, trial, slot: Slot, warm: bool) -> TrialSpec:
        """What the trial's ranks run: fn(trial) or fn(**params), on the slot's share of the cores."""
        if self.server is None:
            params, environ = dict(trial.params), {}
        else:
            params, environ = None, self.server.environ
        return TrialSpec(self.fn, trial.number, params, environ, slot.threads, slot.cores, warm)

    def _run(self, trial, slot: Slot, reporter: _Reporter) -> Result:
        """The trial as a call on the slot's warm worker (one device, on this machine), else as a
        launch of its own (several devices, a cluster, start= other than the template)."""
        assert self.runner is not None, "trials run after the slots started"
        output, note = functools.partial(self._say, trial.number), functools.partial(self._note, trial.number)
        if self.workers is None or slot.size != 1:
            display = self.runner.display(on_update=reporter.update, on_output=output, on_note=note)
            try:
                return launch(functools.partial(run_trial, self._spec(trial, slot, False)),
                              devices=slot.launch_devices, accelerator=slot.accelerator, strategy=self.strategy,
                              start=self.start, cluster=self.cluster, progress=display)
            finally:
                display.release()

        def update(state, final: bool) -> None:  # a live rank's call ends by an interrupt, its process kept
            try:
                reporter.update(state, final)
            except _Pruned as pruned:
                reporter.pruned = pruned
                raise KeyboardInterrupt from None

        # The start turn only for a slot whose process starts now (its first trial, or after a failure).
        display = self.runner.display(on_update=update, on_output=output, on_note=note,
                                      starts=not self.workers.started(slot))
        try:
            return self.workers.run(slot, self._spec(trial, slot, True), display)
        except KeyboardInterrupt:
            if reporter.pruned is not None and not self.runner.stopping.is_set():
                raise reporter.pruned from None
            raise
        finally:
            display.release()

    def work(self, slot: Slot) -> bool:
        trial = self._next()
        if trial is None:
            return False
        TrialState = self.optuna.trial.TrialState
        with self.lock:
            trial.set_user_attr(SLOT, str(slot))
        row = TrialRow(trial.number, dict(trial.params), str(slot))
        self.state.add(row)
        reporter = _Reporter(self, trial, row, reports=self.server is None)
        if self.server is not None:
            self.server.add(trial.number, trial, reporter.heard)
        try:
            result = self._run(trial, slot, reporter)
        except _Pruned as pruned:
            self._end(trial, row, "pruned", f"pruned at step {pruned.step}", TrialState.PRUNED)
            return True
        except KeyboardInterrupt:
            with self.lock:
                trial.set_user_attr(INTERRUPTED, True)
            self._end(trial, row, "interrupted", "stopped by Ctrl-C (resumed: run again)", TrialState.FAIL)
            raise
        except WorkerError as error:
            with self.lock:
                trial.set_user_attr(ERROR, why(error))
                trial.set_user_attr(TRACEBACK, name_cells(error.traceback)[-TRACEBACK_CHARS:])  # In[3], not a temp file
            self._end(trial, row, "failed", why(error), TrialState.FAIL)
            if not isinstance(error, self.catch):
                raise
            self.failures.append(error)
            return True
        except BaseException as error:  # refused in the notebook (cannot be sent, bad settings): so would the rest be
            self._end(trial, row, "failed", f"{type(error).__name__}: {error}".splitlines()[0], TrialState.FAIL)
            raise
        finally:
            if self.server is not None:
                self.server.remove(trial.number)
        if result.value is PRUNED:
            self._end(trial, row, "pruned", f"pruned at step {row.step}" if row.step is not None else "pruned",
                      TrialState.PRUNED)
            return True
        value = objective(result, self.metric, returned_first=self.server is not None)
        if value is None:
            if self.server is None:
                self._end(trial, row, "failed", f"logged no {self.metric!r}", TrialState.FAIL)
                raise ValueError(f"trial {trial.number} logged no {self.metric!r} (ctx.log({self.metric!r}, value)) "
                                 "and returned no number: the sweep needs one of them as the trial's value.")
            reason = f"returned {type(result.value).__name__}, not a number (an objective returns its value)"
            self._fail(trial, row, reason)
            return True
        if math.isnan(value):
            self._fail(trial, row, f"its value is {value!r} ({'returned' if self.server else 'logged or returned'}), "
                       "which Optuna does not take")
            return True
        memory = device_memory(result)
        with self.lock:
            if memory is not None:  # trials that share a GPU (trials_per_device): what each one held
                trial.set_user_attr(GPU_MEMORY, memory)
            told = self.study.tell(trial, value, skip_if_finished=True)
            row.value = value
            if told.state != TrialState.COMPLETE:  # Optuna refused the value: the trial failed
                self._finish_row(row, "failed", f"its value, {value!r}, is not one Optuna accepts")
                return True
            self._finish_row(row, "complete", f"GPU memory {memory / 2**30:.2f} GiB" if memory is not None else "")
            best = self._best()
            if best is not None and best[0] == trial.number:
                self.best = (trial.number, result)  # the model of the best trial so far; earlier ones are let go
        return True

    def verdict(self) -> str:
        """How the sweep ended: 'finished', or why the study holds no complete trial."""
        if self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,)):
            return "finished"
        rows = list(self.state.rows.values())
        if not rows:
            late = self.remaining and self.deadline is not None
            why = ("stop_after passed before the first trial could start" if late
                   else "none of the study's trials is complete")
            return f"ended with no complete trial ({why})"
        if self.failures and len(self.failures) == len(rows):
            return f"failed: every trial failed ({len(rows)})"
        states = ", ".join(f"{n} {state}" for state, n in sorted(self.state.counts().items()))
        first = next((r.detail for r in sorted(rows, key=lambda r: r.number) if r.state == "failed"), "")
        return f"ended with no complete trial ({states}{': ' + first if first else ''})"

    def _fail(self, trial, row: TrialRow, reason: str) -> None:
        """A trial that ran but gave no value Optuna takes: failed, its reason kept in the study."""
        with self.lock:
            trial.set_user_attr(ERROR, reason)
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL, skip_if_finished=True)
            self._finish_row(row, "failed", reason)

    def _end(self, trial, row: TrialRow, state: str, detail: str, optuna_state) -> None:
        with self.lock:
            self.study.tell(trial, state=optuna_state, skip_if_finished=True)
            self._finish_row(row, state, detail)

    def _finish_row(self, row: TrialRow, state: str, detail: str) -> None:
        self._best()  # first: a view that sees the row ended sees the best with it
        row.state, row.detail, row.ended = state, detail, time.monotonic()
        self.changed()

    def _best(self):
        try:
            best = self.study.best_trial
        except ValueError:  # no trial complete yet
            return None
        self.state.best = (best.number, best.value, dict(best.params))
        return self.state.best


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
    optuna = _optuna()
    stop_after = renamed_timeout(timeout, stop_after)
    space, catch, with_trial = check_sweep(fn, space, trials, metric, direction, sampler, pruner, stop_after, catch)
    view = make_view(progress)
    if cluster is None:
        slots, idle = plan_slots(devices, devices_per_trial, accelerator, per_device=trials_per_device)
        strategy, start = slot_start(strategy, start)
    else:
        check_cluster_words(words(strategy, start), cluster)  # refused here, not by every trial
        if trials_per_device != 1:
            raise ValueError(f"trials_per_device={trials_per_device!r} with cluster=: the cluster places each trial; "
                             "give devices= (how many devices the sweep holds at once) instead.")
        if with_trial:  # its trials would dial the notebook's loopback-only trial channel
            raise ValueError(f"sweep({study_name(fn)}) with cluster=: a trial on a cluster cannot yet ask the study "
                             "in this notebook; give space= (Optuna distributions) and a fn(**params) that reports "
                             "with ctx.log, or run the objective on this machine's devices.")
        slots, idle = cluster_slots(devices, devices_per_trial, accelerator), None
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
        run = _SweepRun(optuna, study, fn, space, metric, catch, trials - done,
                        None if stop_after is None else time.monotonic() + stop_after, strategy, start, cluster, state,
                        view)
        server = run.server = TrialServer(run.lock) if with_trial else None
        run._best()
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


def device_memory(result: Result) -> int | None:
    """The most GPU memory a trial's first rank held (bytes, NVML's figure for its process, sampled
    about once a second: a trial shorter than that may have none), or None (a CPU trial)."""
    held = [v.gpu_memory for v in result.vitals if v.gpu_memory is not None and v.rank == 0]
    return max(held) if held else None


def importances(optuna, study) -> dict[str, float] | None:
    """Optuna's parameter importances (its default evaluator), for the summary: where two complete trials or more
    varied a parameter, and the study is small enough to take a moment."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not 2 <= len(complete) <= IMPORTANCE_TRIALS:
        return None
    try:
        with warnings.catch_warnings():  # "fewer than 2 trials in a regime": the summary is no place for it
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
    except Exception as exc:  # a parameter that never varied, a single-valued space: no importances, nothing wrong
        log.debug("no parameter importances: %s", exc)
        return None
    return dict(found) or None


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
    optuna = _optuna()
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
