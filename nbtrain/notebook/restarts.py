"""Restarts (`max_restarts=N`): when an attempt fails, all ranks start again, up to N times
(torch elastic's model). The code resumes from its own last checkpoint; a submitted run keeps
it in `ctx.run_dir`. `launch` restarts here (on a cluster, each attempt is a new job or new
actors); a submitted run's supervisor (`detached.py`) too, attempt by attempt, with its status
written in between."""
from __future__ import annotations

from typing import Callable

from ..common.errors import WorkerError
from .result import Result


def check_restarts(max_restarts) -> int:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give a whole number of restarts, 0 or more.")
    return max_restarts


def why(error: Exception) -> str:
    """One line: "rank 1 failed: exited with code 1", or, for code that ran in this process, the
    exception's first line."""
    if isinstance(error, WorkerError):
        said = error.summary.splitlines()[0] if error.summary else ""
        # "rank 1 ended without a reply: ..." names its rank already
        return said if said.startswith(f"rank {error.rank} ") else f"rank {error.rank} failed: {said}"
    return f"{type(error).__name__}: {error}".splitlines()[0]


def restarting(attempt: int, max_restarts: int, reason: str) -> str:
    return f"restarting ({attempt + 1} of {max_restarts}): {reason}"


def with_restarts(run: Callable[[], Result], max_restarts: int, display, only=Exception) -> Result:
    """`run()` until it returns, at most 1 + `max_restarts` times; the Result says why each restart.
    Errors that are not `only` end it at once (a cluster job that can never start)."""
    reasons: list[str] = []
    for attempt in range(max_restarts + 1):
        try:
            result = run()
        except Exception as error:  # a WorkerError; the code's own exception where it ran in this process
            if attempt == max_restarts or not isinstance(error, only):
                raise
            reasons.append(why(error))
            display.note(restarting(attempt, max_restarts, reasons[-1]))
            continue
        result.restarts = reasons
        return result
    raise AssertionError("not reached: the last attempt returns or raises")
