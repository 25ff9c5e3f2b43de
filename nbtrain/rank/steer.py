"""Steering on the rank side: hold at the step boundary every rank agreed on, do there what the notebook asks.

A step boundary is an iteration of the innermost `ctx.progress` loop (or a `ctx.step()` call).
The rank's listener thread (`loop.py`) hands the notebook's steering messages to
`Steering.on_message`, which sets `pending`; the main thread looks at `pending` at every
boundary and calls `at_boundary` only when it is set, so a boundary with nothing asked costs one
attribute check. The notebook (`notebook/run/steer.py`) agrees the step: it asks every rank to hold
at its next boundary, hears where each stopped, and moves the target to the furthest, so those
behind run on to it; what it sends then runs on the main thread, where the training's objects live.

An exported job makes a steered run's changes again (`Replay`, from the job's changes.json): the
sets and the stop at the steps they were made at, so the job trains as the steered run did.
"""
from __future__ import annotations

import inspect
import threading
import traceback
from collections import deque
from pathlib import Path

from ..common import protocol
from ..common.private import read_own_json
from ..common.transfer import pack_result
from .tally import progressed

HOLD_BEAT = 1.0  # while held, how often the doctor hears that this rank is alive (no stall is said)
CHANGES = "changes.json"  # in an exported job: the steered run's changes (`protocol.Change`, as dicts)
# What an exported job makes again: a call's function is not kept, and a checkpoint would overwrite the run's own.
REPLAYED = ("set", "stop")


class Steering:
    """One rank's steering state: written by the listener thread, read by the main thread at boundaries."""

    def __init__(self, rank: int, emit) -> None:
        self.pending = False  # the one thing a boundary reads when nothing is asked
        self.stopping = False  # `run.stop()`: every progress loop ends at its next iteration
        self.steps = 0  # step boundaries passed in this command
        self.objects: dict[str, object] = {}  # what the training registered (`ctx.steer`)
        self._rank, self._emit = rank, emit
        self._cond = threading.Condition()
        self._holding = False
        self._target: int | None = None  # hold at the first boundary at or past it; None: the next one
        self._work: deque = deque()
        self._replay: deque = deque()  # an exported job's changes still to make (`Replay`), by step

    def reset(self) -> None:
        """A new command: nothing registered, steps from 0. A hold asked for already stays (a
        `pause()` that came while the rank was still starting holds at the command's first boundary)."""
        with self._cond:
            self.stopping, self.steps, self.objects = False, 0, {}
            self._replay.clear()
            self.pending = self._holding

    def replay(self, changes: list[dict]) -> None:
        """Make `changes` (`protocol.Change` as dicts: set and stop) again at their steps."""
        with self._cond:
            self._replay.extend(sorted(changes, key=lambda c: c["step"]))
            self.pending = self.pending or bool(self._replay)

    # -- the listener thread -------------------------------------------------------------
    def on_message(self, message) -> None:
        with self._cond:
            if isinstance(message, protocol.SteerHold):
                if not self._holding:  # where the main thread is: it cannot hold before its next boundary
                    self._emit(protocol.SteerHeld(self._rank, self.steps, False))
                self._holding, self._target = True, message.step
                self.pending = True
            elif isinstance(message, protocol.SteerResume):
                self._holding, self._target = False, None
                self.pending = self.stopping or bool(self._replay)
            else:
                self._work.append(message)
            self._cond.notify_all()

    # -- the main thread -----------------------------------------------------------------
    def at_boundary(self, counted: bool) -> bool:
        """A boundary with something pending (`counted`: a step boundary, not an outer loop's
        iteration); True when the loop must end here (`run.stop()`)."""
        if counted:
            if self._replay:
                self._replay_due()
            with self._cond:
                reported = None
                while self._holding and (self._target is None or self.steps >= self._target):
                    if reported != self.steps:
                        self._emit(protocol.SteerHeld(self._rank, self.steps))
                        reported = self.steps
                    while self._work:
                        apply = self._work.popleft()
                        self._cond.release()  # the listener may queue more while this runs
                        try:
                            self._apply(apply)
                        finally:
                            self._cond.acquire()
                    if self._holding and not self._work:
                        self._cond.wait(HOLD_BEAT)
                        progressed()  # held on purpose: not a stall
        return self.stopping

    def _replay_due(self) -> None:
        """The replayed changes whose step has come, made as the steered run made them there."""
        while self._replay and self._replay[0]["step"] <= self.steps:
            change = self._replay.popleft()
            if change["what"] == "stop":
                self.stopping = True
                continue
            args = change["args"]
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in args["values"].items()}  # JSON's lists
            try:
                self._set_values(values, args["optimizer"])
            except ValueError as error:
                raise ValueError(f"the exported job replays the steered run's change at step {change['step']} "
                                 f"({change['detail']}), and cannot: {error}") from None
        with self._cond:
            self.pending = self._holding or self.stopping or bool(self._replay)

    def _apply(self, apply: protocol.SteerApply) -> None:
        try:
            value = getattr(self, f"_{apply.what}")(apply.payload)
            done = protocol.SteerDone(self._rank, apply.seq, self.steps, pack_result(value, self._rank, keep=True))
        except Exception as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            done = protocol.SteerDone(self._rank, apply.seq, self.steps, None, text)
        self._emit(done)

    def _call(self, payload: bytes):
        import dill

        fn, = dill.loads(payload)
        return fn(**self._arguments(fn))

    def _arguments(self, fn) -> dict:
        """What `fn` takes of the registered objects (and `ctx`, `step`): by its parameters' names,
        or all of them when it takes ``**kwargs``."""
        from .context import context

        offered = {**self.objects, "step": self.steps}
        offered.setdefault("ctx", context())
        parameters = inspect.signature(fn).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            return offered
        missing = [p.name for p in parameters if p.name not in offered and p.default is p.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise TypeError(f"run.call(fn): fn takes {missing}, which the training did not register; registered: "
                            f"{sorted(self.objects)} (ctx.steer(name=obj)), and always ctx, step.")
        return {p.name: offered[p.name] for p in parameters if p.name in offered}

    def _set(self, payload: bytes):
        import pickle

        return self._set_values(*pickle.loads(payload))

    def _set_values(self, values: dict, name: str | None) -> list[str]:
        optimizers = {n: o for n, o in self.objects.items() if hasattr(o, "param_groups")}
        if name is not None:
            optimizers = {n: o for n, o in optimizers.items() if n == name}
        if not optimizers:
            said = f"no optimizer registered as {name!r}" if name else "no optimizer registered"
            raise ValueError(f"run.set: {said}; register it in the training: ctx.steer(optimizer=opt). Registered: "
                             f"{sorted(self.objects)}.")
        for opt_name, optimizer in optimizers.items():
            for key in values:
                if any(key not in group for group in optimizer.param_groups):
                    known = sorted(optimizer.param_groups[0]) if optimizer.param_groups else []
                    raise ValueError(f"run.set({key}=...): optimizer {opt_name!r} has no {key!r} in its param "
                                     f"groups; it has {[k for k in known if k != 'params']}.")
        for optimizer in optimizers.values():
            for group in optimizer.param_groups:
                group.update(values)
        return sorted(optimizers)

    def _checkpoint(self, payload: bytes):
        import pickle

        from .context import context

        path, = pickle.loads(payload)
        if not self.objects:
            raise ValueError("run.checkpoint: nothing registered to save; register it in the training: "
                             "ctx.steer(model=model, optimizer=opt).")
        context().save_checkpoint(path, **self.objects, step=self.steps)
        return str(path)

    def _stop(self, payload):
        with self._cond:
            self.stopping = self.pending = True
        return self.steps



class Replay:
    """`fn`, run with a steered run's changes made again at their steps: an exported job's
    function when the job has changes.json (`replaying`)."""

    def __init__(self, fn, changes: list[dict]):
        self.fn, self.changes = fn, changes
        self.__name__ = self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, *args, **kwargs):
        from .context import context

        context()._steering.replay(self.changes)
        return self.fn(*args, **kwargs)


def replaying(fn, job_dir):
    """`fn` as an exported job in `job_dir` runs it: with its changes.json's sets and stop made
    again (`Replay`), or as it is."""
    path = Path(job_dir) / CHANGES
    if not path.exists():
        return fn
    changes = [c for c in read_own_json(path) if c["what"] in REPLAYED]
    return Replay(fn, changes) if changes else fn
