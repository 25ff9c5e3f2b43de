"""Live ranks' lifetime: their options (checked once, as a launch's are: `RunOptions`), the pool
they start, its close and restart, the registry of open ones (`Ranks.current`, closed at exit),
and the one path every call's command takes to the pool: refused while a background run holds
the ranks, the notebook's reloads followed first, a rank's failure kept for `debug`, and fresh
ranks after one that could not be interrupted. `ranks.py`'s `Ranks` adds the calls.
"""
from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from typing import TypeVar

from ...common.devices import DevicePlan, plan_devices
from ...common.errors import WorkerError
from ...display import check_progress
from ...display.lazy import LazyDisplay
from ...display.text import QuietDisplay
from ...placements.base import Job
from ...placements.clusters import ClusterJob, check_cluster
from ..run.background import BackgroundRun, SteerablePool
from ..run.choices import LIVE_WRAPPINGS, choose, words
from ..run.options import RunOptions, check_timeout
from ..run.pool import Pool, PoolBroken
from ..run.reloads import RELOAD_SOURCE, ModuleVersions
from ..run.starts import LIVE_STARTS, launcher_for
from .payloads import check_targets

START_METHODS = LIVE_STARTS  # the table's starts that can host live ranks (run/starts.py)
WRAPPINGS = LIVE_WRAPPINGS
_open: weakref.WeakValueDictionary[int, RanksLifetime] = weakref.WeakValueDictionary()
_order = itertools.count()
R = TypeVar("R", bound="RanksLifetime")


class RanksLifetime:
    """What every call on live ranks stands on (`Ranks` is the public class, documented there)."""

    def __init__(self, devices="auto", accelerator: str = "auto", backend: str | None = None,
                 timeout: float | None = None, strategy: str = "auto", start: str = "auto", progress=True,
                 cluster=None, num_nodes: int = 1, stall: float | bool | None = None):
        if type(num_nodes) is not int or num_nodes < 1 or (num_nodes > 1 and cluster is None):
            raise ValueError(f"num_nodes={num_nodes!r}: give an int >= 1; more than one node needs a cluster "
                             "(cluster=nbtrain.Slurm(...) or nbtrain.Ray(...)).")
        # What a launch takes too, checked as a launch checks it; then what live ranks take of it.
        self.options = RunOptions(strategy, start, devices, accelerator, num_nodes, backend, timeout, stall)
        asked = self.options.asked
        strategy, start = choose(asked, None, "live").strategy, asked.start  # checked; the start is chosen at _start
        asked.say()
        check_progress(progress)
        if cluster is not None:
            if start != "auto":
                raise ValueError(f"start={start!r} with cluster={cluster!r}: the cluster's engine starts the ranks.")
            self.plan: DevicePlan = check_cluster(cluster).plan(devices, accelerator, backend, num_nodes)
        else:
            self.plan = plan_devices(devices, accelerator, backend)
        self.cluster = cluster
        self.strategy, self.start_method, self.progress = strategy, start, progress
        self.placement = ""
        self._pool: Pool | None = None
        self._last_failure: int | None = None
        self._background: BackgroundRun | None = None  # `run(..., wait=False)`'s, while it runs
        self._start()

    @property
    def timeout(self) -> float | None:
        """The default limit, in seconds, of each call (None: none)."""
        return self.options.timeout

    @property
    def stall(self) -> float | bool | None:
        """Each call's `stall=`, as for `launch`."""
        return self.options.stall

    # -- life ----------------------------------------------------------------------------
    def _start(self) -> None:
        make_job: type[Job]
        display = QuietDisplay()
        if self.cluster is not None:
            launcher, self.placement, note, make_job = self.cluster.placement(), self.cluster.engine, None, ClusterJob
        else:
            choice = choose(words(self.strategy, self.start_method), None, "live")
            launcher, note, make_job = launcher_for(choice.start, display), choice.note, Job
            self.placement = launcher.start
        # Live ranks: no fn, the commands come later.
        job = make_job(None, (), {}, self.plan, self.strategy, stall=self.stall,  # type: ignore[arg-type]
                       start_timeout=120.0, start=self.placement)
        if note:
            display.note(note)
        started = time.monotonic()
        pool = SteerablePool(launcher, job, live=True)  # `run(..., wait=False)` is steered through it
        try:
            pool.start(display)
        except BaseException:
            pool.close(False, display)
            raise
        self._pool = pool
        self._modules = ModuleVersions()  # what the ranks' imports match; reloads in the notebook follow
        self._key = next(_order)
        _open[self._key] = self
        if self.progress is not False and os.environ.get("NBTRAIN_PROGRESS", "").strip() != "0":  # quiet: not said
            display.note(f"{self.world_size} live ranks ({self.placement}, {self.plan.describe()}) ready in "
                         f"{time.monotonic() - started:.2f} s")

    @property
    def world_size(self) -> int:
        """How many ranks."""
        return self.plan.world_size

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._pool is None

    def close(self) -> None:
        """Stop the ranks; their state is gone. Also done at kernel exit, and by ``with``.

        Returns
        -------
        None
        """
        self._close("closed by .close()")

    def _close(self, why: str) -> None:
        run = getattr(self, "_background", None)  # None: never started (a bad argument), or nothing ran
        if run is not None and threading.current_thread() is not run._thread:
            run.cancel()  # `run(fn, wait=False)` still going: its watcher lets go of the ranks first
        pool, self._pool = self._pool, None
        _open.pop(getattr(self, "_key", -1), None)
        if pool is not None:
            pool.close(True, QuietDisplay(), why)

    def restart(self) -> None:
        """Fresh ranks in place of these, their state lost: after a crash, or to start over.

        Returns
        -------
        None
        """
        self._close("restarted by .restart()")
        self._start()

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        broken = self._pool.broken if self._pool is not None else None
        state = "closed" if self.closed else (f"broken: {broken}" if broken else "ready")
        return f"Ranks(world_size={self.world_size}, {self.placement}, {self.plan.describe()}, {state})"

    @classmethod
    def current(cls: type[R]) -> R:
        """The Ranks that ``%%ranks`` cells use: the last started and not closed.

        Returns
        -------
        Ranks

        Raises
        ------
        LookupError
            No live ranks.
        """
        alive = [r for _, r in sorted(_open.items()) if not r.closed and isinstance(r, cls)]
        if not alive:
            raise LookupError("no live ranks: start them with `ranks = nbtrain.Ranks(devices=2)` or `%nbtrain start`.")
        return alive[-1]

    def __len__(self) -> int:
        return self.world_size


    def debug(self, rank: int | None = None, commands: list[str] | None = None) -> None:
        """pdb in a rank's last failure, from this notebook (``%debug`` after a WorkerError does it too).

        Parameters
        ----------
        rank : int, optional
            Default: the rank that failed last.
        commands : list of str, optional
            pdb commands typed for you first (``["p x.shape", "up", "q"]``); the prompt follows
            unless they end the session, so a notebook run top to bottom does not stop at it.

        Returns
        -------
        None

        Raises
        ------
        RuntimeError
            No rank has failed yet.
        TypeError
            ``commands`` is not a list of str.
        """
        rank = self._last_failure if rank is None else rank
        if rank is None:
            raise RuntimeError("no rank has failed yet: there is nothing to debug. (breakpoint() in code run on "
                               "the ranks also opens pdb here.)")
        if commands is not None and (isinstance(commands, str) or not all(isinstance(c, str) for c in commands)):
            raise TypeError(f"debug(commands={commands!r}): give a list of pdb commands, e.g. ['p x.shape', 'q'].")
        self._command("debug", list(commands or []), ranks=[rank])


    # -- plumbing ------------------------------------------------------------------------
    def _refuse_while_running(self) -> None:
        run = self._background
        if run is not None and not run.done() and threading.current_thread() is not run._thread:
            raise RuntimeError("these live ranks run a function in the background (ranks.run(fn, wait=False)): they "
                               "take the next command once it ends; wait with run.result(), or end it with run.stop() "
                               "or run.cancel().")

    def _command(self, kind: str, *args, ranks=None, timeout=None, namespace=None, display=None, title=""):
        if self._pool is None:
            raise PoolBroken("these live ranks are closed: start new ones with nbtrain.Ranks(...), or .restart().")
        self._refuse_while_running()
        ranks = check_targets(ranks, self.world_size)

        timeout = check_timeout(timeout) if timeout is not None else self.timeout
        display = display or LazyDisplay(self.progress)
        pool = self._pool
        try:
            if kind in ("exec", "eval", "call"):
                self._follow_reloads(pool, timeout)
            return pool.command(kind, *args, ranks=ranks, display=display, timeout=timeout, namespace=namespace,
                                title=title)
        except WorkerError as error:
            self._last_failure = error.rank
            if not pool.restart_reason and not pool.broken:
                error.debug = lambda rank=error.rank: self.debug(rank)  # type: ignore[attr-defined]  # `%debug` opens the rank's pdb
            raise
        finally:
            if pool.restart_reason:
                self.restart()

    def _follow_reloads(self, pool: Pool, timeout) -> None:
        """Modules the notebook reloaded (`importlib.reload`) are reloaded on every rank first, so
        the command runs the code the notebook has, and said in one line."""
        names = self._modules.reloaded()
        if names:
            display = QuietDisplay()
            pool.command("exec", RELOAD_SOURCE.format(names=names), "<nbtrain reload>", False, display=display,
                               timeout=timeout)
            display.note(f"live ranks reloaded {', '.join(names)}, as the notebook did")



@atexit.register
def _close_all() -> None:
    for ranks in list(_open.values()):
        try:
            ranks.close()
        except Exception:
            pass
