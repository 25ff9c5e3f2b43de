"""One call of `sweep` at work: each slot's trials asked of the study, run, and told back.

`SweepRun.work(slot)` is what a slot's thread does for one trial: ask the study for it, run it
(a call on the slot's warm process, `sweep_workers.py`, or a launch of its own), report what it
logs to Optuna as it runs (`Reporter`, whose pruner may end it at once), and tell the study how
it ended, keeping the row the view draws in step. The study is told from the slots' threads and
the trial server's, under one lock; the view is drawn from the main thread only (`tick`).
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
import threading
import time
import warnings
from collections import deque

from ...common.errors import WorkerError
from ...common.tracebacks import name_cells
from ...display.sweep_view import SweepState, TrialRow
from ...rank.trial import PRUNED, TrialSpec, run_trial
from ..run.launch import launch
from ..run.restarts import why
from ..run.result import Result
from .slots import Slot, SlotRunner
from .sweep_study import ERROR, GPU_MEMORY, INTERRUPTED, KERNEL, SLOT, TRACEBACK, TRACEBACK_CHARS, this_kernel
from .sweep_trials import TrialServer
from .sweep_workers import TrialWorkers

log = logging.getLogger(__name__)

IMPORTANCE_TRIALS = 2000  # beyond this, the evaluator's seconds are not spent on a summary
SAID_LINES = 10_000  # stderr lines remembered, to show a library's banner once per sweep rather than per trial


class _Pruned(Exception):
    """Raised in a trial's display when Optuna's pruner says stop: its launch ends at once."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


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


class Reporter:
    """One trial's progress, as its launch reports it: to the row, and (fn(**params) trials) its
    `metric` to Optuna, whose pruner is asked. A fn(trial) trial reports itself (`heard`)."""

    def __init__(self, run: SweepRun, trial, row: TrialRow, reports: bool):
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


class SweepRun:
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

    def _run(self, trial, slot: Slot, reporter: Reporter) -> Result:
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
        reporter = Reporter(self, trial, row, reports=self.server is None)
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
            best = self.note_best()
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
        self.note_best()  # first: a view that sees the row ended sees the best with it
        row.state, row.detail, row.ended = state, detail, time.monotonic()
        self.changed()

    def note_best(self):
        """The study's best trial so far, put in the view's state (None while no trial is complete)."""
        try:
            best = self.study.best_trial
        except ValueError:  # no trial complete yet
            return None
        self.state.best = (best.number, best.value, dict(best.params))
        return self.state.best


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

