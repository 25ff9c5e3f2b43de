"""Steering a submitted run from any kernel: requests and answers as files in its run directory.

The run's supervisor (`detached/supervise.py`) runs its launch in the background (`launch(wait=False)`) and,
until it ends, serves `steer/request-N.pkl`: each names a `BackgroundRun` method (pause, call,
set, checkpoint, resume, stop) and its arguments; the answer, what the method returned or what
it raised, is `steer/answer-N.pkl`. A kernel that attached (`Run.pause()` & co.) writes the
request and waits for the answer. Both sides write through runlog's whole private writes and read
through its checked reads, so a request is never read half written, nor from another account.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ...common import runlog
from ...common.pickling import ship_bytes

STEER_DIR = "steer"
METHODS = ("pause", "resume", "call", "set", "checkpoint", "stop")
POLL = 0.05  # seconds between looks, on both sides
ANSWER_WAIT = 60.0  # beyond a request's own timeout: how long the kernel waits for the supervisor to answer


def serve(run, run_dir: Path):
    """The supervisor's wait for its background `run`: requests answered until it ends; its Result
    (or its error). A cancel (SIGTERM, as KeyboardInterrupt) stops the ranks first."""
    folder = run_dir / STEER_DIR
    if not os.path.lexists(folder):  # made by the first attempt; a restart's serves it again
        runlog.make_private_dir(folder, "the run's steering requests")
    try:
        while not run.done():
            for path in sorted(folder.glob("request-*.pkl")):
                _answer(run, path)
            time.sleep(POLL)
    except KeyboardInterrupt:
        run.cancel()
        raise
    return run.result()


def _answer(run, path: Path) -> None:
    name = path.name.removeprefix("request-")
    try:
        method, args, kwargs = runlog.read_pickle(path)
        if method not in METHODS:
            raise ValueError(f"a steering request for {method!r}: accepted: {', '.join(METHODS)}")
        reply = (True, getattr(run, method)(*args, **kwargs))
    except Exception as error:  # the kernel that asked raises it
        reply = (False, error)
    finally:
        path.unlink(missing_ok=True)
    try:
        data = ship_bytes(reply)
    except Exception as error:  # an answer that cannot travel: say so instead
        data = ship_bytes((False, RuntimeError(f"the answer to {path.name} cannot be sent back: {error}")))
    runlog.write_whole(path.with_name(f"answer-{name}"), data)


def ask(run_dir: Path, ended, method: str, *args, timeout: float | None = None, **kwargs):
    """Ask the supervisor of the run in `run_dir` to do `method`; what it returned (or raise what it
    raised). `ended()` says whether the run has ended (then nothing will answer)."""
    folder = run_dir / STEER_DIR
    if ended() or not folder.is_dir():
        raise RuntimeError(f"the run in {run_dir} cannot be steered now: it has ended, has not started its ranks yet, "
                           "or runs in one process, on a cluster, or under an nbtrain without steering.")
    name = f"{time.time_ns():020d}-{os.getpid()}.pkl"
    request, answer = folder / f"request-{name}", folder / f"answer-{name}"
    runlog.write_whole(request, ship_bytes((method, args, kwargs)))
    limit = None if timeout is None else timeout + ANSWER_WAIT
    started = time.monotonic()
    try:
        while not answer.exists():
            if ended() and not answer.exists():
                raise RuntimeError(f"the run in {run_dir} ended before it answered run.{method}()")
            if limit is not None and time.monotonic() - started > limit:
                raise TimeoutError(f"the run's supervisor did not answer run.{method}() within {limit:g} s")
            time.sleep(POLL)
    finally:
        request.unlink(missing_ok=True)  # not taken yet: never taken now
    ok, value = runlog.read_pickle(answer)
    answer.unlink(missing_ok=True)
    if not ok:
        raise value
    return value
