"""What every steerable run offers: `launch(wait=False)`'s `BackgroundRun` (the kernel talks to
its ranks) and a submitted `Run` (through its run directory, from any kernel). Each says how a
request reaches the ranks (`_steered`); the requests and their words are here, once. Nothing here
imports torch: `nbtrain runs` reads `Run`s without it."""
from __future__ import annotations

import os

PAUSE_TIMEOUT = 30.0  # seconds `pause()` waits for every rank to reach the agreed boundary


class Steering:
    """Pause, call, set, checkpoint, resume and stop a run's training at one step every rank agrees on."""

    def _steered(self, method: str, timeout: float | None, *args, **kwargs):
        """Make the request `method` of the ranks (see `steer.Steerer`) and return its answer."""
        raise NotImplementedError

    def pause(self, timeout: float = PAUSE_TIMEOUT) -> int:
        """Hold every rank at the same step boundary, and return that step.

        Each rank stops at its next boundary (an iteration of the innermost ``ctx.progress``
        loop, or ``ctx.step()``); ranks behind the furthest run on to it, so they all hold after
        the same number of steps. Already paused: the step it holds at.

        Parameters
        ----------
        timeout : float, default 30
            Seconds to wait for every rank to reach the agreed boundary.

        Returns
        -------
        int
            The step every rank holds at (steps done in the training function so far).

        Raises
        ------
        TimeoutError
            A rank did not reach a step boundary in time (the message says where each is); every
            rank goes on.
        RuntimeError
            The run has ended (or its error, if it failed).
        """
        return self._steered("pause", timeout)

    def resume(self) -> None:
        """Let every rank go on from the step it holds at (nothing happens when not paused)."""
        self._steered("resume", None)

    def call(self, fn, timeout: float | None = None) -> list:
        """Run ``fn`` on every rank at the agreed step, and return each rank's answer.

        ``fn`` gets, by its parameters' names, what the training registered with ``ctx.steer``
        (``lambda model, optimizer: ...``), and ``ctx`` and ``step``; ``**kwargs`` takes them all.
        A run that was not paused is paused for the call and resumed after it.

        Parameters
        ----------
        fn : callable
            Run on each rank's main thread, where the training's objects live.
        timeout : float, optional
            Seconds to wait for every rank's answer; None: as long as the run lives.

        Returns
        -------
        list
            Each rank's return value, in rank order.

        Raises
        ------
        SteerError
            ``fn`` raised on a rank (every failing rank's traceback is in the message); the ranks
            stay held.
        TypeError
            ``fn`` is not callable.
        """
        return self._steered("call", timeout, fn)

    def set(self, optimizer: str | None = None, timeout: float | None = None, **values) -> None:
        """Set hyper-parameters of the registered optimizers in every param group, on every rank
        at the same step: ``run.set(lr=1e-3)``.

        Parameters
        ----------
        optimizer : str, optional
            The name it was registered under (``ctx.steer(opt=...)``); None: every registered optimizer.
        timeout : float, optional
            Seconds to wait for every rank; None: as long as the run lives.
        **values
            The param group keys to set (``lr``, ``weight_decay``, ``momentum``...).

        Raises
        ------
        SteerError
            No optimizer is registered (under that name), or a key is not in its param groups.
        """
        self._steered("set", timeout, optimizer=optimizer, **values)

    def checkpoint(self, path, timeout: float | None = None) -> None:
        """Save every registered object (and ``step``) at the agreed step, as ``ctx.save_checkpoint``:
        every rank writes its shard, and ``ctx.load_checkpoint`` reads it back.

        Parameters
        ----------
        path : str or Path
            The checkpoint's directory, as the ranks see it.
        timeout : float, optional
            Seconds to wait for every rank; None: as long as the run lives.
        """
        self._steered("checkpoint", timeout, os.fspath(path))

    def stop(self, timeout: float = PAUSE_TIMEOUT) -> int:
        """End the training at the agreed step, as if its loops had finished: every ``ctx.progress``
        loop ends there, so the function returns what it returns (the model) to `result`.

        Parameters
        ----------
        timeout : float, default 30
            Seconds for every rank to reach the agreed boundary.

        Returns
        -------
        int
            The step the training stopped at.
        """
        return self._steered("stop", timeout)
