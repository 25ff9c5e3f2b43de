"""A sweep's warm workers: each one-device slot keeps one live rank and runs its trials there.

A trial as a launch of its own paid for a process, its rendezvous and its channels every time
(about 0.12 s on 2 CPU slots, a trial's whole length for a small objective); a trial that is a
call on a live rank (`Ranks.run`, about 1 ms) pays once per slot. Each call is still a run of its
own: its output, metrics, progress, Result and failure are that call's (the live ranks' commands
keep them apart), and an interrupt stops the call, not the process (a pruned trial frees its
slot at once, its process stays warm). A trial that failed leaves the next a fresh process: what
broke it (a CUDA error, a corrupt state, a process that died) does not fail the trials after it.
The trials' function, with what it carries (a notebook function's globals, a dataset it reads),
goes to a slot's process with its first trial and is kept there, as Optuna's own threads share
it: the slot's later trials carry only their parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import types
import uuid
from collections.abc import Callable

from ...common.transfer import pack_job
from ...rank.trial import FUNCTION_WANTED, TrialSpec, run_trial
from ..live.ranks import Ranks
from ..run.result import Result
from .slots import Slot

log = logging.getLogger(__name__)

# What the live rank runs: builtins only, so its globals (the rank's namespace) need nothing from
# the notebook; no attribute either (`.unpack_job`), which the rank would take for a global it lacks
# and ask the notebook for at every trial. Its argument is the trial (`rank/trial.py`, the user's
# objective in it) packed as a launch packs its job: a notebook's function, its cell's lines for
# tracebacks, its classes.
_SOURCE = ('def _nbtrain_trial(job):\n'
           '    unpack = getattr(__import__("nbtrain.common.transfer", None, None, ["unpack_job"]), "unpack_job")\n'
           '    fn, args, kwargs = unpack(job)\n'
           '    return fn(*args, **kwargs)\n')
_namespace: dict = {}
exec(compile(_SOURCE, "<nbtrain trial>", "exec"), _namespace)
TRIAL: types.FunctionType = _namespace["_nbtrain_trial"]


class TrialWorkers:
    """One live rank per slot, started at its first trial, closed by `close` (the sweep's end)."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.sweep = uuid.uuid4().hex  # the key its ranks keep the trials' function under
        self._ranks: dict[int, Ranks] = {}
        self._holding: set[int] = set()  # slots whose process holds the function (sent with an earlier trial)
        self._lock = threading.Lock()
        self._closed = False

    def started(self, slot: Slot) -> bool:
        """Whether `slot` has its process (its next trial starts none)."""
        ranks = self._ranks.get(slot.index)
        return ranks is not None and not ranks.closed

    def run(self, slot: Slot, spec: TrialSpec, display) -> Result:
        """The trial `spec` on `slot`'s live rank (started now if it has none): its Result.

        Raises what the call raises (`WorkerError`, KeyboardInterrupt); after a failure the slot's
        next trial gets a fresh process."""
        ranks = self._ranks.get(slot.index)
        if ranks is None or ranks.closed:
            ranks = Ranks(devices=slot.launch_devices, accelerator=slot.accelerator, strategy=self.strategy,
                          start="template", progress=False)
            with self._lock:
                if self._closed:  # the sweep ended while this one started
                    ranks.close()
                    raise KeyboardInterrupt
                self._ranks[slot.index] = ranks
                self._holding.discard(slot.index)
        try:
            if slot.index in self._holding:  # its process has the function: the trial goes without it
                result = ranks.run(TRIAL, pack_job(run_trial, (dataclasses.replace(spec, fn=None, sweep=self.sweep),),
                                                   {}), progress=display)
                if result.value is not FUNCTION_WANTED:
                    return result
                self._holding.discard(slot.index)  # a fresh process (restarted): send it again
            result = ranks.run(TRIAL, pack_job(run_trial, (dataclasses.replace(spec, sweep=self.sweep),), {}),
                               progress=display)
            self._holding.add(slot.index)
            return result
        except KeyboardInterrupt:
            raise  # the call was interrupted; the process keeps going (or the sweep closes it)
        except BaseException:
            self._retire(slot.index)
            raise

    def _retire(self, index: int) -> None:
        with self._lock:
            ranks = self._ranks.pop(index, None)
            self._holding.discard(index)
        if ranks is not None:
            ranks.close()

    def close(self) -> None:
        """Stop every slot's process and wait until they are gone (in parallel, each bounded)."""
        self.closing()()

    def closing(self) -> Callable[[], None]:
        """Start stopping every slot's process; what to call to wait until they are gone. The
        sweep draws its summary meanwhile (a process's exit takes 0.05-0.2 s)."""
        with self._lock:
            self._closed = True
            indices = list(self._ranks)
        threads = [threading.Thread(target=self._retire, args=(i,), name="nbtrain-sweep-close", daemon=True)
                   for i in indices]
        for thread in threads:
            thread.start()

        def wait() -> None:
            for thread in threads:
                thread.join()
        return wait
