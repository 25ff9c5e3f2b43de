"""The notebook's side of `objective(trial)`: the study answers each trial's ranks.

A sweep whose function takes Optuna's trial opens one channel (a `Hub`, beside each trial's run
channel, as a map's work queue does) for all its trials. A rank's `RemoteTrial`
(`rank/trial.py`) sends `TrialAsk` (`suggest_float`, `report`, `should_prune`, `params`...); a
thread here calls that on the trial's own `optuna.trial.Trial`, under the sweep's lock (the
study is told by the slots' threads too), and sends back the value or what Optuna raised.
Only the methods and attributes a trial's code uses are served.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from ...common import protocol
from ...common.channel import Hub
from ...common.transfer import pack_exception

log = logging.getLogger(__name__)

METHODS = frozenset({"suggest_float", "suggest_int", "suggest_categorical", "suggest_uniform", "suggest_loguniform",
                     "suggest_discrete_uniform", "report", "should_prune", "set_user_attr", "set_system_attr"})
ATTRIBUTES = frozenset({"params", "distributions", "user_attrs", "system_attrs", "datetime_start"})


class TrialServer:
    """Answers the trials' `TrialAsk`s from their Optuna trials, on a thread of its own.

    `add(number, trial, heard)` serves a trial (`heard(method, args, value)` is told each answer:
    the sweep's row follows its parameters and reports); `remove(number)` stops serving it."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self._trials: dict[int, tuple[object, Callable]] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.hub = Hub(self.inbox)
        self.hub.start()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nbtrain-sweep-trials", daemon=True)
        self._thread.start()

    @property
    def environ(self) -> dict[str, str]:
        return self.hub.environ

    def add(self, number: int, trial, heard: Callable) -> None:
        self._trials[number] = (trial, heard)

    def remove(self, number: int) -> None:
        self._trials.pop(number, None)

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(message, protocol.TrialAsk):
                self.hub.send(message.rank, self._answer(message))

    def _answer(self, ask: protocol.TrialAsk) -> protocol.TrialAnswer:
        served = self._trials.get(ask.trial)
        try:
            if served is None:
                raise RuntimeError(f"trial {ask.trial} is no longer running in the notebook's sweep")
            trial, heard = served
            if ask.method in ATTRIBUTES:
                with self._lock:
                    value = getattr(trial, ask.method)
            elif ask.method in METHODS:
                with self._lock:
                    value = getattr(trial, ask.method)(*ask.args, **ask.kwargs)
            else:
                raise AttributeError(f"nbtrain's trial in a rank does not serve {ask.method!r}; it serves "
                                     f"{', '.join(sorted(METHODS | ATTRIBUTES))}")
        except Exception as exc:  # Optuna's refusal (a distribution changed, a bad range): raised in the rank
            return protocol.TrialAnswer(None, pack_exception(exc)
                                        or pack_exception(RuntimeError(f"{type(exc).__name__}: {exc}")))
        try:
            heard(ask.method, ask.args, value)
        except Exception:  # drawing must not fail a trial
            log.debug("sweep row update", exc_info=True)
        return protocol.TrialAnswer(value)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5.0)
        self.hub.close()
