"""One device, or DataParallel over several: the function runs in the kernel itself."""
from __future__ import annotations

import signal
import threading
import time
import traceback

import torch

from ...common import protocol
from ...common.errors import WorkerError
from ...common.transfer import to_cpu
from ...placements.base import Job
from ...rank.context import Context, set_current
from .result import Result
from .runmodel import RunState


class _TimedOut(BaseException):
    pass


class _StateSink:
    def __init__(self, state: RunState, display):
        self.state, self.display = state, display

    def emit(self, message) -> None:
        self.state.handle(message)
        self.display.update(self.state)  # the display throttles itself


class _Alarm:
    """`timeout` for code running on the kernel's own thread: SIGALRM interrupts it there."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds if threading.current_thread() is threading.main_thread() else None

    def _ring(self, signum, frame):
        raise _TimedOut("".join(traceback.format_stack(frame)))

    def __enter__(self):
        if self.seconds:
            self._previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)


class InProcessLauncher:
    strategy = "single"

    def launch(self, job: Job, display) -> Result:
        plan = job.plan
        gpu = plan.accelerator == "gpu"
        device = torch.device("cuda", plan.indices[0]) if gpu else torch.device("cpu")
        dp_ids = plan.indices if (gpu and job.strategy == "dp") else ()
        state = RunState(f"{job.strategy} on {plan.describe()}", [0])
        ctx = Context(device=device, strategy=job.strategy, backend=plan.backend,
                      sink=_StateSink(state, display), dp_device_ids=dp_ids)
        display.start(state)
        state.handle(protocol.Hello(0, None))
        previous = set_current(ctx)
        ok = False
        try:
            with _Alarm(job.timeout):
                value = job.fn(*job.args, **job.kwargs)
            state.finish(0, to_cpu(value))
            ok = True
        except _TimedOut as stuck:
            state.fail(0, f"timed out after {job.timeout:g} s")
            raise WorkerError(0, f"timed out after {job.timeout:g} s", f"--- rank 0 stack ---\n{stuck}") from None
        except Exception as exc:
            state.fail(0, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            set_current(previous)
            state.ended = time.monotonic()
            display.finish(state, ok)
        return Result.from_state(state, job.strategy, plan.describe(), job.start)
