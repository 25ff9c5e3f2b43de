"""A launch's ranks stuck past its `timeout=` (or interrupted after a stall note), kept where they
wait so that `%debug` or ``error.debug(rank)`` opens their frames before they are stopped: text pdb
from a thread of the rank's own, or JupyterLab's panel when it is on (`debugger.post_mortem`).
The supervisor asks `keep_stalled`; `launch` leaves a kept pool open (`held`) and stops the
ranks an earlier launch left (`release_stalled`).
"""
from __future__ import annotations

import sys
import threading

from .debugger import DebugPort, _active, post_mortem

KEEP_SECONDS = 600.0  # a stalled launch's ranks kept for %debug are stopped by then if no cell ran


class StalledRanks:
    """A launch's ranks stuck past its `timeout=`, kept as they are so `%debug` (or
    ``error.debug(rank)``) opens their frames where they wait: text pdb, or the panel when it is
    on. Stopped when a cell that does not debug them ends, when another launch starts, or after
    KEEP_SECONDS."""

    def __init__(self, pool, ranks: list[int], shell):
        self.pool, self.ranks, self.shell = pool, list(ranks), shell
        port = getattr(pool, "_inbox", None)  # a pool's inbox is its DebugPort (pool.py)
        self.port = port if isinstance(port, DebugPort) else None
        self.debugged = True  # in this cell: the launch's own counts
        self._lock = threading.Lock()
        self._timer = threading.Timer(KEEP_SECONDS, self.stop)
        self._timer.daemon = True
        self._timer.start()
        shell.events.register("post_run_cell", self._after_cell)

    def how(self) -> str:
        return (f"Ranks {self.ranks} are kept where they wait until a cell that does not debug them ends: %debug "
                f"opens rank {self.ranks[0]}'s frames (error.debug(rank) another's), in the debugger panel when it "
                "is on.")

    def _after_cell(self, result=None) -> None:
        if not (self.debugged or (self.port is not None and self.port.opened)):
            self.stop()
        self.debugged = False
        if self.port is not None:
            self.port.opened = False

    def debug(self, rank: int | None = None, commands: list[str] | None = None) -> None:
        """Text pdb at the frames where `rank` (default: the first kept) waits, or the panel when it
        is on and no `commands` are given; it looks (where, up, down, p), never steps."""
        rank = self.ranks[0] if rank is None else rank
        if rank not in self.ranks:
            raise ValueError(f"debug(rank={rank!r}): the ranks kept are {self.ranks}.")
        if commands is not None and (isinstance(commands, str) or not all(isinstance(c, str) for c in commands)):
            raise TypeError(f"debug(commands={commands!r}): give a list of pdb commands, e.g. ['where', 'p x', 'q'].")
        with self._lock:
            if self.pool is None:
                raise RuntimeError(f"rank {rank} was stopped: stalled ranks are kept only until a cell that does "
                                   "not debug them ends.")
            if commands is None and self.port is not None and post_mortem(rank, self.port):
                print(f"nbtrain: rank {rank}'s frames are open in the debugger panel; continue closes them.")
                return
            self.debugged = True
            from ...display.text import QuietDisplay

            self.pool.command("debug", list(commands or []), ranks=[rank], display=QuietDisplay())

    def stop(self) -> None:
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is None:
            return
        self._timer.cancel()
        try:
            self.shell.events.unregister("post_run_cell", self._after_cell)
        except ValueError:
            pass
        _kept.pop(id(pool), None)
        if _active and self.port is not None:  # the panel hears that those it showed are gone
            for rank in self.ranks:
                _active[0].ended(self.port, rank)
        pool.close(False)


_kept: dict[int, StalledRanks] = {}  # id(pool): its kept ranks


def keep_stalled(pool, ranks: list[int]) -> StalledRanks | None:
    """Keep the stuck ranks of a launch that timed out, for `%debug`: in a notebook (IPython) only,
    from its main thread (a launch in the background has no cell after it to end them), on this
    machine (a cluster's allocation is not held for it)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if pool.live or pool.remote or not ranks or shell is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    kept = _kept[id(pool)] = StalledRanks(pool, ranks, shell)
    return kept


def held(pool) -> bool:
    """`pool`'s ranks are kept for `%debug` (its launch leaves them to `StalledRanks`)."""
    return id(pool) in _kept and _kept[id(pool)].pool is pool


def release_stalled() -> None:
    """Stop the ranks kept from an earlier launch (before another starts: their devices are freed)."""
    for kept in list(_kept.values()):
        kept.stop()
