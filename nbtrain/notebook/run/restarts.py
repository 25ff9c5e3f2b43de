"""Restarts (`max_restarts=N`): when an attempt fails, all ranks start again, up to N times
(torch elastic's model). The code resumes from its own last checkpoint; a submitted run keeps
it in `ctx.run_dir`. `launch` restarts here (on a cluster, each attempt is a new job or new
actors); a submitted run's supervisor (`detached/supervise.py`) too, attempt by attempt, with its status
written in between.

A restart waits first, longer each time: BACK_OFF_FIRST seconds, doubling up to BACK_OFF_CAP, so
a cause that takes a while to clear (a node rebooting, a file system catching up) is not hit
again at once, and a run that fails at start does not spin. The wait is a plain sleep in the
caller's main thread: Ctrl-C in a kernel, or a submitted run's cancel (SIGTERM, raised there as
KeyboardInterrupt), ends it at once."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ...common.errors import WorkerError
from .result import Result

BACK_OFF_FIRST = 1.0  # seconds before the first restart
BACK_OFF_CAP = 60.0  # ... doubling each time, to at most this
# With the waits capped at a minute, 100 restarts are more than an hour and a half of them: a run
# that fails this often fails for a reason of its own, which the restarts' reasons say.
MAX_RESTARTS = 100
T = TypeVar("T")


def check_restarts(max_restarts) -> int:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give a whole number of restarts, 0 to {MAX_RESTARTS}.")
    if max_restarts > MAX_RESTARTS:
        raise ValueError(f"max_restarts={max_restarts!r}: at most {MAX_RESTARTS}. A run that fails more often than "
                         "that fails for a reason of its own: Result.restarts (or the run's status) says why each "
                         "attempt failed.")
    return max_restarts


def back_off(attempt: int) -> float:
    """Seconds to wait after attempt `attempt` (0: the first) failed, before the next one."""
    return min(BACK_OFF_CAP, BACK_OFF_FIRST * 2.0 ** min(attempt, 64))


def wait_to_restart(attempt: int, max_restarts: int) -> None:
    """The back-off after attempt `attempt` failed, in this thread (Ctrl-C or SIGTERM end it: the
    KeyboardInterrupt shows as one line, not the sleep's frame)."""
    try:
        time.sleep(back_off(attempt))
    except KeyboardInterrupt as interrupt:
        said = (f"KeyboardInterrupt: interrupted while waiting to restart ({attempt + 1} of {max_restarts}); "
                "no rank was running.")
        interrupt._render_traceback_ = lambda said=said: [said]  # type: ignore[attr-defined]  # what IPython shows
        raise


def why(error: BaseException) -> str:
    """One line: "rank 1 failed: exited with code 1", or, for code that ran in this process, the
    exception's first line."""
    if isinstance(error, WorkerError):
        said = error.summary.splitlines()[0] if error.summary else ""
        # "rank 1 ended without a reply: ..." names its rank already
        return said if said.startswith(f"rank {error.rank} ") else f"rank {error.rank} failed: {said}"
    return f"{type(error).__name__}: {error}".splitlines()[0]


def restarting(attempt: int, max_restarts: int, reason: str) -> str:
    """The note after attempt `attempt` failed: "restarting (2 of 5) in 2 s: rank 1 failed: ..."."""
    return f"restarting ({attempt + 1} of {max_restarts}) in {back_off(attempt):g} s: {reason}"


def restart_loop(attempt: Callable[[int], T], max_restarts: int, between: Callable[[str, str], object],
                 restartable: Callable[[Exception], bool] = lambda error: True) -> tuple[T, list[str]]:
    """The one restart loop, `launch`'s and a submitted run's supervisor's: `attempt(n)` for n = 0, 1, ...
    until one returns, at most 1 + `max_restarts` times. After a failure that restarts, `between(note,
    reason)` is told ("restarting (2 of 5) in 2 s: rank 1 failed: ...", and the reason alone), then the
    back-off is waited. The last attempt's error, one that is not `restartable` (a cluster job that can
    never start), and a Ctrl-C are raised. Returns the value and why each restart happened."""
    reasons: list[str] = []
    for n in range(max_restarts + 1):
        if n:
            wait_to_restart(n - 1, max_restarts)
        try:
            return attempt(n), reasons
        except Exception as error:  # a WorkerError; the code's own exception where it ran in this process
            if n == max_restarts or not restartable(error):
                raise
            reasons.append(why(error))
        between(restarting(n, max_restarts, reasons[-1]), reasons[-1])
    raise AssertionError("not reached: the last attempt returns or raises")


def with_restarts(run: Callable[[], Result], max_restarts: int, display, only=Exception) -> Result:
    """`run()` until it returns, at most 1 + `max_restarts` times, each restart said on `display`;
    the Result says why each restart happened. Errors that are not `only` end it at once."""
    result, reasons = restart_loop(lambda n: run(), max_restarts, lambda note, reason: display.note(note),
                                   lambda error: isinstance(error, only))
    result.restarts = reasons
    return result
