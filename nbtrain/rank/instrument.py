"""A training function with trackers and a profiler around it, as every rank runs it.

The notebook wraps the user's function (or cell) in an `Instrumented` before it travels, so the
ranks set trackers and the profiler up themselves, wherever and however they were started.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..common import protocol
from ..common.private import new_private_dir
from .context import context
from .profiling import Profile, Recorder
from .tracking import RunInfo, Trackers


@dataclass
class Instrumented:
    fn: Callable
    trackers: tuple = ()
    profile: Profile | None = None
    run_dir: str = ""
    name: str = ""
    settings: dict = field(default_factory=dict)  # the run's hyper-parameters, as the trackers record them

    def __post_init__(self):
        # What a rank names when the function returns: "returned from train()", not from this wrapper.
        self.__qualname__ = getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def __call__(self, *args, **kwargs):
        return self.around(lambda: self.fn(*args, **kwargs))

    def around(self, call: Callable):
        """`call()` on this rank with the trackers open and the profiler recording."""
        ctx = context()
        trackers = recorder = None
        failed = True
        try:
            if self.trackers:
                trackers = Trackers(self.trackers, RunInfo(self.name, self.run_dir, ctx.rank, ctx.world_size,
                                                           self.settings))
                # Every rank passes here together, so handing rank 0's run id round may be a collective.
                trackers.start(lambda value: ctx.all_gather(value)[0])
            if self.profile is not None:
                where = new_private_dir(os.path.join(self.run_dir, "profile"))
                recorder = Recorder(self.profile, ctx.rank, ctx.device, str(where))
            ctx._observe(trackers, recorder)
            value = call()
            failed = False
            return value
        finally:
            ctx._observe(None, None)
            if recorder is not None and recorder.started:
                summary = recorder.stop()
                if not failed:
                    ctx._sink.emit(protocol.Profile(ctx.rank, summary))
            if trackers is not None:
                trackers.close(failed)
