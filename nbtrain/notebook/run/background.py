"""A launch in the background of this kernel: `launch(..., wait=False)` and the handle it returns.

The ranks are started from the calling thread (a fork from another thread could copy a lock the
kernel's main thread holds); the supervisor then watches them from a thread of its own, so the
kernel is free for other cells and a later cell's Ctrl-C, which IPython raises on the main thread
only, never reaches the run. `cancel()` is the run's Ctrl-C: the watching thread takes it as the
supervisor takes the kernel's. Steering (`steer.py`) talks to the ranks through the same pool.

A later launch may fork the kernel while a run is watched: the fork copies whatever lock the
watching thread holds at that moment (the kernel's stdout as it prints, the widgets' comm as it
draws) into the new ranks, held for ever. So the watching thread holds `WATCHING` whenever it
does anything but wait for the ranks' next message, and every fork of this process waits for it
first (`os.register_at_fork`): the ranks of a second launch are forked while the watcher waits.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING

from ...common import protocol
from .choices import IN_KERNEL
from .pool import Pool
from .steer import Steerer, drain_replies
from .steering import Steering

if TYPE_CHECKING:
    from .result import Result

CANCEL_WAIT = 30.0  # seconds `cancel()` waits for the ranks to be stopped
FORK_WAIT = 10.0  # seconds a fork waits for a watching thread to finish what it does (then forks anyway)

WATCHING = threading.Lock()  # held by a background run's watching thread, except while it waits
_forking = threading.local()  # `watching`: this thread is a watching thread; `held`: its fork took WATCHING


def _before_fork() -> None:
    # A watching thread that forks (live ranks restarted from it) holds WATCHING itself.
    _forking.held = not getattr(_forking, "watching", False) and WATCHING.acquire(timeout=FORK_WAIT)


def _after_fork_in_parent() -> None:
    if _forking.held:
        WATCHING.release()


def _after_fork_in_child() -> None:
    global WATCHING
    WATCHING = threading.Lock()  # no thread here holds it, whoever forked


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def waiting():
    """Let forks happen while this watching thread waits (it holds `WATCHING` otherwise)."""
    WATCHING.release()
    try:
        yield
    finally:
        WATCHING.acquire()


def check_background(start: str, max_restarts: int) -> None:
    """What `wait=False` needs: rank processes of its own, and no restarts (slept on the caller's thread)."""
    if start == IN_KERNEL:
        raise ValueError("launch(wait=False) runs the ranks as processes beside this kernel, but one device runs the "
                         "function in the kernel itself: give devices=2 (or more), or start='fork'/'template'/'spawn'.")
    if max_restarts:
        raise ValueError(f"launch(wait=False, max_restarts={max_restarts}): restarts are not offered in the "
                         "background; give max_restarts=0, or use nbtrain.submit for a run that restarts itself.")


class SteerablePool(Pool):
    """A pool whose runs can be steered and cancelled from another thread than the one watching
    them: the ranks' steering replies go to `replies` rather than to the supervisor, and `cancel`
    is the watcher's Ctrl-C. Live ranks' pools are such pools (``Ranks.run(..., wait=False)``)."""

    def __init__(self, launcher, job, live: bool):
        super().__init__(launcher, job, live)
        self.replies: queue.Queue = queue.Queue()
        self._where: dict[int, protocol.Whereabouts] = {}
        self._cancel = threading.Event()
        self._cancelled = False
        self.watching_thread: threading.Thread | None = None  # a background run's, which holds `WATCHING`

    def arm(self) -> None:
        """A background run begins: no cancel yet, no earlier run's replies."""
        self._cancel.clear()
        self._cancelled = False
        drain_replies(self.replies)

    def cancel(self) -> None:
        self._cancel.set()

    def receive(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            if self._cancel.is_set() and not self._cancelled:
                self._cancelled = True
                raise KeyboardInterrupt  # as the kernel's Ctrl-C reaches a launch that waits
            wait = min(max(deadline - time.monotonic(), 0.0), 0.1)
            with waiting() if threading.current_thread() is self.watching_thread else contextlib.nullcontext():
                message = super().receive(wait)
            if isinstance(message, protocol.STEER_REPLIES):
                self.replies.put(message)
            else:
                if isinstance(message, protocol.Whereabouts):
                    self._where[message.rank] = message
                if message is not None or time.monotonic() >= deadline:
                    return message

    def send(self, rank: int, message) -> bool:
        return self._hub.send(rank, message)

    def connected(self, rank: int) -> bool:
        """`rank` has reached the notebook: what is sent to it now arrives."""
        return self._hub.connected(rank)

    def where_now(self, ranks: list[int], wait: float) -> dict[int, protocol.Whereabouts]:
        """Where each listed rank's main thread is (those that answered within `wait` s)."""
        for rank in ranks:
            self._where.pop(rank, None)
        self.ask_where(ranks)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(r in self._where for r in ranks):
            time.sleep(0.02)
        return {r: self._where[r] for r in ranks if r in self._where}


class BackgroundPool(SteerablePool):
    """A launch's pool whose watch runs later, on the run's thread (`watch`)."""

    def __init__(self, launcher, job):
        super().__init__(launcher, job, live=False)
        self._watching: tuple | None = None

    def _watch(self, state, display, timeout, start_timeout, interrupt=None) -> None:
        if self._watching is None:  # `start` on the caller's thread: the ranks are started, the watch waits
            self._watching = (state, display, timeout, start_timeout, interrupt)
            return
        super()._watch(state, display, timeout, start_timeout, interrupt)

    def watch(self) -> None:
        """Watch the run to its end (on the run's thread)."""
        assert self._watching is not None, "started first"
        super()._watch(*self._watching)


class BackgroundRun(Steering):
    """A run started by ``launch(..., wait=False)`` or live ranks' ``run(..., wait=False)``: it
    trains while the kernel runs other cells.

    Wait for it with `result`, end it with `cancel`, or steer it at a step boundary (an iteration
    of ``ctx.progress``, or ``ctx.step()``) that every rank agrees on: `pause`, `call`, `set`,
    `checkpoint`, `resume`, `stop`. Each change is kept with its step (`changes`, and
    ``Result.changes``).
    """

    def __init__(self, pool: SteerablePool, finish, display, state=None, ranks: list[int] | None = None):
        self._pool, self._display = pool, display
        self._state = state or (lambda: pool.state)  # the run's model (None until it is made)
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._steer = Steerer(pool, self._going, self._step_time, self._told, ranks)
        self._thread = threading.Thread(target=self._run, args=(finish,), name="nbtrain-background-run", daemon=True)

    def _start(self) -> BackgroundRun:
        self._pool.arm()
        self._thread.start()
        return self

    def _run(self, finish) -> None:
        _forking.watching = True
        try:
            with WATCHING:  # a fork waits while this thread draws, closes, makes the Result
                self._pool.watching_thread = threading.current_thread()
                try:
                    self._result = finish()
                finally:
                    self._pool.watching_thread = None
        except BaseException as exc:  # handed to whoever asks for the result
            self._error = exc

    # -- the run's end -----------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled)."""
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the run to end and return its `Result` (``changes`` lists what was steered).

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None: until it ends. Ctrl-C stops the waiting, not the run.

        Returns
        -------
        Result

        Raises
        ------
        TimeoutError
            The run is still going after ``timeout`` s.
        WorkerError
            A rank failed, timed out or died, as ``launch`` raises it.
        concurrent.futures.CancelledError
            The run was cancelled.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run is still going after {timeout:g} s (run.done() says when it has ended).")
        if self._cancelled:
            raise CancelledError("the run was cancelled (run.cancel()); its ranks were stopped (live ranks: "
                                 "interrupted, and kept).")
        if self._error is not None:
            raise self._error
        assert self._result is not None, "a run that ended without an error has its result"
        return self._result

    def cancel(self) -> bool:
        """Stop every rank now, as Ctrl-C stops a launch that waits (live ranks: interrupts them, as
        Ctrl-C does a cell); False if the run had ended."""
        if self.done():
            return False
        self._cancelled = True
        self._pool.cancel()
        self._thread.join(CANCEL_WAIT)
        return True

    def _told(self, change: protocol.Change) -> None:
        """A change made on every rank: into the run's model (its events, the chart's marks), and said."""
        state = self._state()
        if state is not None:
            state.add_change(change)
        self._display.note(f"step {change.step}: {change.detail} on every rank")

    def _going(self) -> None:
        """Raise when the run is over: its error, or that it ended."""
        if not self.done():
            return
        if self._error is not None and not self._cancelled:
            raise self._error
        raise RuntimeError("the run has ended: there is nothing to steer (run.result() gives what it returned).")

    def _step_time(self) -> float | None:
        state = self._state()
        rates = [rate for view in list(state.ranks.values()) if (rate := view.step_rate)] if state else []
        return 1.0 / min(rates) if rates else None

    # -- steering ----------------------------------------------------------------------------
    def _steered(self, method: str, timeout: float | None, *args, **kwargs):
        if method == "resume":
            return self._steer.resume()
        if method == "set":
            optimizer = kwargs.pop("optimizer")
            return self._steer.set(kwargs, optimizer, timeout)
        return getattr(self._steer, method)(*args, timeout)

    def metrics(self, name: str, rank: int | None = 0) -> list[float]:
        """The values logged under one name so far (as ``Result.metrics``), while the run trains.

        Parameters
        ----------
        name : str
            The name given to ``ctx.log``.
        rank : int or None, default 0
            Whose values: a rank, or None for every rank's.

        Returns
        -------
        list of float
        """
        state = self._state()
        history = list(state.history) if state is not None else []
        return [m.value for m in history if m.name == name and (rank is None or m.rank == rank)]

    @property
    def changes(self) -> list[protocol.Change]:
        """What was changed so far, each with the step it was applied at on every rank."""
        return list(self._steer.changes)

    def __repr__(self) -> str:
        state = self._state()
        title = state.title if state is not None else "a run"
        if self.done():
            how = "cancelled" if self._cancelled else "failed" if self._error is not None else "finished"
        else:
            held = self._steer.held_at
            how = "running" if held is None else f"paused at step {held}"
        return f"<nbtrain run in the background: {title}, {how}>"


def start_in_background(launcher, job, display, finish) -> BackgroundRun:
    """Start `job`'s ranks from this thread and watch them from another; `finish(pool, watch)`
    watches, stops the ranks and makes the `Result` (launch's own, so both ends are the same)."""
    pool = BackgroundPool(launcher, job)
    try:
        pool.start(display, job.timeout)
    except BaseException:
        pool.close(False, display)
        if pool.state is not None:
            display.finish(pool.state, False)
        raise
    return BackgroundRun(pool, lambda: finish(pool, pool.watch), display)._start()


class _Shown:
    """A display, and the state its `start` was given (a live ranks' command makes its own)."""

    def __init__(self, display):
        self._display, self.state, self.started = display, None, threading.Event()

    def start(self, state) -> None:
        self.state = state
        try:
            self._display.start(state)
        finally:
            self.started.set()

    def __getattr__(self, name):
        return getattr(self._display, name)


def run_in_background(pool: SteerablePool, command, display, ranks: list[int]) -> BackgroundRun:
    """Live ranks' ``run(fn, wait=False)``: ``command(display)``, the pool's command to its Result,
    watched from a thread of its own; returned once its view is shown, while this cell still runs
    (the kernel sends what a thread shows to the cell running then)."""
    shown = _Shown(display)
    run = BackgroundRun(pool, lambda: command(shown), shown, lambda: shown.state, ranks)._start()
    try:
        while not shown.started.wait(0.05) and not run.done():
            pass
    except KeyboardInterrupt:  # before it was shown: as a Ctrl-C of a command that waits
        run.cancel()
        raise
    if run.done() and run._error is not None:  # refused before it began (closed ranks, say)
        raise run._error
    return run
