"""Steering on the notebook side: agree on one step boundary with every rank, act there, remember it.

`pause` asks every rank to hold at its next boundary (`rank/steer.py`). Each rank's listener thread
answers at once with the boundaries its main thread has passed (it can hold at the next one at the
earliest), and the main thread reports the step it holds at. The target is the furthest step any
rank can reach, and every rank behind it runs on to it. Under DDP a rank may be one step ahead of
a held one, waiting in that step's collective for it: its listener's answer moves the target there
at once. Should a rank stay silent (its listener starved), when every rank heard is held at the
target for a grace period the target moves one step on. No collective is added to a step: the
agreement travels on the run's channel, and only while a pause is asked.
"""
from __future__ import annotations

import pickle
import queue
import time
from collections.abc import Callable

from ...common import protocol
from ...common.pickling import ship_bytes
from ...common.transfer import unpack_result
from .doctor import stall_verdict
from .steering import PAUSE_TIMEOUT

GRACE = (0.05, 2.0)  # silent ranks: the target moves on after 2 step times, within these bounds (s)
WHERE_WAIT = 1.0  # for the silent ranks' whereabouts, once a pause timed out
POLL = 0.05  # seconds between looks at whether the run is still going


class SteerError(RuntimeError):
    """What a steering request raised on the ranks (their tracebacks follow); the ranks stay held."""


class Steerer:
    """Pause, act and resume a background run's ranks through its pool (`background.BackgroundPool`).

    `going()` raises when the run is over (its error, or a word that it ended); `step_time()` is
    the run's recent step time in seconds, or None; `told(change)` hears each change made (the
    run's model and live view).
    """

    def __init__(self, pool, going: Callable[[], None], step_time: Callable[[], float | None],
                 told: Callable[[protocol.Change], None], ranks: list[int] | None = None):
        self._pool, self._going, self._step_time, self._told = pool, going, step_time, told
        self.ranks = list(pool.ranks if ranks is None else ranks)
        self.held_at: int | None = None  # the step every rank holds at, while paused
        self.changes: list[protocol.Change] = []
        self._seq = 0

    # -- pause and resume ------------------------------------------------------------------
    def pause(self, timeout: float = PAUSE_TIMEOUT) -> int:
        """`run.pause()`: `hold`, remembered as a change."""
        if self.held_at is not None:
            self._going()
            return self.held_at
        step = self.hold(timeout)
        self._record(step, "pause", "paused")
        return step

    def resume(self) -> None:
        """`run.resume()`: `release`, remembered as a change when the ranks were held."""
        step = self.held_at
        self.release()
        if step is not None:
            self._record(step, "resume", "resumed")

    def hold(self, timeout: float = PAUSE_TIMEOUT) -> int:
        """Hold every rank at one step boundary; the step (already held: that step)."""
        self._going()  # a run that ended while paused holds nothing
        if self.held_at is not None:
            return self.held_at
        drain_replies(self._pool.replies)
        deadline = time.monotonic() + timeout
        while not all(self._pool.connected(r) for r in self.ranks) and time.monotonic() < deadline:
            self._going()  # ranks still starting (a pause right after launch): a hold sent now would be lost
            time.sleep(0.01)
        self._send(protocol.SteerHold(None))
        try:
            self.held_at = self._agree(deadline, timeout)
        except BaseException:  # timed out, interrupted, the run ended: no rank stays held
            self._send(protocol.SteerResume())
            raise
        return self.held_at

    def _agree(self, deadline: float, timeout: float) -> int:
        held: dict[int, int] = {}  # rank: the step it holds at
        passed: dict[int, int] = {}  # rank: boundaries it had passed as the hold came (it holds at one more)
        target: int | None = None
        moved = time.monotonic()
        while True:
            reply = self._reply(min(deadline, time.monotonic() + POLL))  # None: look again (the grace below)
            if reply is None and time.monotonic() >= deadline:
                raise self._not_at_boundary(held, passed, timeout)
            if isinstance(reply, protocol.SteerHeld):
                (held if reply.held else passed)[reply.rank] = reply.step
            now = time.monotonic()
            # The earliest step each rank can hold at: where it holds, or the boundary after those it passed.
            reachable = [held.get(r, passed[r] + 1 if r in passed else None) for r in self.ranks]
            furthest = max((s for s in reachable if s is not None), default=None)
            if furthest is not None and (target is None or furthest > target):
                target, moved = furthest, now
                self._send(protocol.SteerHold(target))  # those behind run on to it
            if target is None or not held:
                continue
            if len(held) == len(self.ranks) and all(step == target for step in held.values()):
                return target
            unheard = any(r not in held and r not in passed for r in self.ranks)
            if unheard and all(step == target for step in held.values()) and now - moved > self._grace():
                target, moved = target + 1, now  # a silent rank may wait for the held ones in the next step
                self._send(protocol.SteerHold(target))

    def _grace(self) -> float:
        step = self._step_time()
        return min(max(2 * step, GRACE[0]), GRACE[1]) if step else GRACE[0]

    def release(self) -> None:
        """Let every rank go on from the boundary it holds at."""
        if self.held_at is None:
            return
        self._send(protocol.SteerResume())
        self.held_at = None

    # -- acting at the boundary --------------------------------------------------------------
    def apply(self, what: str, payload: bytes | None, detail: str, timeout: float | None,
              args: dict | None = None) -> list:
        """Do `what` on every rank at the agreed step (pausing first, and resuming after, when the
        run was not paused); every rank's answer, in rank order."""
        paused_here = self.held_at is None
        step = self.hold()
        try:
            self._seq += 1
            self._send(protocol.SteerApply(self._seq, what, payload))
            answers = self._answers(self._seq, timeout)
        finally:
            if paused_here or what == "stop":  # a stopped run's ranks leave their loops at this boundary
                self.release()
        self._record(step, what, detail, args)
        return answers

    def _record(self, step: int, what: str, detail: str, args: dict | None = None) -> None:
        change = protocol.Change(step, what, detail, time.time(), args)
        self.changes.append(change)
        self._told(change)

    def _answers(self, seq: int, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        done: dict[int, protocol.SteerDone] = {}
        while len(done) < len(self.ranks):
            reply = self._reply(deadline)
            if reply is None:
                missing = [r for r in self.ranks if r not in done]
                raise TimeoutError(f"ranks {missing} did not answer within {timeout:g} s; they are still held at step "
                                   f"{self.held_at} (run.resume() lets them go on once they answer).")
            if isinstance(reply, protocol.SteerDone) and reply.seq == seq:
                done[reply.rank] = reply
        failed = [d for r, d in sorted(done.items()) if d.error]
        if failed:
            tracebacks = "\n".join(f"--- rank {d.rank} ---\n{d.error}" for d in failed)
            last = failed[0].error.strip().splitlines()[-1]
            raise SteerError(f"{last} (on ranks {[d.rank for d in failed]}); the ranks are held at step "
                             f"{self.held_at}: run.resume() goes on.\n{tracebacks}")
        return [unpack_result(done[r].payload) for r in self.ranks]  # type: ignore[arg-type]

    def call(self, fn: Callable, timeout: float | None) -> list:
        if not callable(fn):
            raise TypeError(f"run.call(fn): fn must be callable (it gets the objects the training registered with "
                            f"ctx.steer by its parameters' names), got {type(fn).__name__}.")
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return self.apply("call", ship_bytes((fn,)), f"{name}() called", timeout)

    def set(self, values: dict, optimizer: str | None, timeout: float | None) -> list:
        if not values:
            raise ValueError("run.set() needs the hyper-parameters to set: run.set(lr=0.01)")
        bad = {k: v for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float, tuple))}
        if bad:
            raise TypeError(f"run.set({', '.join(f'{k}={v!r}' for k, v in bad.items())}): a param group's value is a "
                            "number (or a tuple, such as Adam's betas).")
        words = ", ".join(f"{k}={v!r}" for k, v in values.items())
        return self.apply("set", pickle.dumps((values, optimizer)), f"set {words}", timeout,
                          {"values": values, "optimizer": optimizer})

    def checkpoint(self, path, timeout: float | None) -> None:
        self.apply("checkpoint", pickle.dumps((str(path),)), f"checkpoint saved to {path}", timeout,
                   {"path": str(path)})

    def stop(self, timeout: float) -> int:
        step = self.hold(timeout)
        self.apply("stop", None, "stopped", None)
        return step

    # -- the channel -------------------------------------------------------------------------
    def _send(self, message) -> None:
        for rank in self.ranks:
            self._pool.send(rank, message)

    def _reply(self, deadline: float | None):
        """The next steering reply before `deadline` (None: when the run ends); None once it passed."""
        while True:
            wait = POLL if deadline is None else min(POLL, max(deadline - time.monotonic(), 0.0))
            try:
                return self._pool.replies.get(timeout=wait)
            except queue.Empty:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._going()  # after the queue: answers that came just before the run ended still count

    def _not_at_boundary(self, held: dict[int, int], passed: dict[int, int], timeout: float) -> TimeoutError:
        silent = [r for r in self.ranks if r not in held]
        where = self._pool.where_now(silent, WHERE_WAIT) if silent else {}
        at = (f"; ranks {sorted(held)} stopped at steps {[held[r] for r in sorted(held)]}" if held else "")
        never = [r for r in silent if passed.get(r) == 0]
        if never:
            at += f"; ranks {never} have passed no step boundary in this run"
        verdict = stall_verdict(where, [r for r in silent if r not in where]).text if silent else ""
        return TimeoutError(
            f"run.pause(): ranks {silent or self.ranks} did not reach a step boundary within {timeout:g} s{at}. "
            f"{verdict} Steering holds at the iterations of ctx.progress (or at ctx.step()): a training loop "
            "that uses neither has no step boundary. Every rank goes on.")


def drain_replies(replies: queue.Queue) -> None:
    while True:
        try:
            replies.get_nowait()
        except queue.Empty:
            return
