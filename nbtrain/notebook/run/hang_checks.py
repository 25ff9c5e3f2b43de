"""The doctor's questions while a command runs and after it failed: a stall (no rank progressed
for `stall=` s: where each is, whom the others wait for), a rank that ended while the others wait
for it, a failure that was only a lost peer, a backend's mismatch. A part of `Supervisor`, whose
loop calls `_check_stall` and `_check_early_exit` each tick and `_blame_early_end`, `_say_waits`
and `_mismatch` while it settles a failure; the verdicts' words are `doctor.py`'s."""
from __future__ import annotations

import re
import time
from typing import Any

from ...common import protocol
from .doctor import (
    Verdict,
    backward_of,
    call_words,
    each_call,
    ended_verdict,
    facts,
    mismatch_words,
    mismatched_calls,
    stall_after,
    stall_verdict,
)
from .runmodel import RunState
from .stacks import blocked_on_peers, exception_message
from .watched import Watched

EARLY_EXIT_AFTER = 1.0  # a rank ended this long ago while others still run: look at where they wait
EARLY_EXIT_PROBES = 2  # consecutive stacks showing the same wait before it counts as a deadlock
PROBE_INTERVAL = 1.0
WHERE_WAIT = 1.0  # for the ranks' answers to `Where`: a rank holding the GIL in C code does not answer
STALL_RECHECK = 0.25  # the least time between two questions to the ranks about a stall
BACKEND_MISMATCH = re.compile(r"collective mismatch|doesn't match expected size")


class HangChecks:
    """The supervisor's hang checks; they read and keep the state below (`Supervisor.__init__` sets it)."""

    pool: Watched
    state: RunState
    display: Any
    stall: float | bool | None
    _where: dict[int, protocol.Whereabouts]
    _probes: dict[int, tuple[tuple | str | None, int]]
    _probed: float
    _stall_probe: float
    _stall_said: bool

    def _pump(self, timeout: float, until_settled: bool = False) -> None:
        raise NotImplementedError

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        raise NotImplementedError

    def ask_where(self, ranks: list[int]) -> dict[int, protocol.Whereabouts]:
        """Where each listed rank is now (those that answered within WHERE_WAIT)."""
        for rank in ranks:
            self._where.pop(rank, None)
        self.pool.ask_where(ranks)
        deadline = time.monotonic() + WHERE_WAIT
        while time.monotonic() < deadline and not all(r in self._where for r in ranks):
            self._pump(0.02)
        return {r: self._where[r] for r in ranks if r in self._where}

    def _diagnose(self, ranks: list[int]) -> Verdict | None:
        running = [r for r in ranks if self.state.ranks[r].status == "running"]
        where = self.ask_where(running) if running else {}
        if not where:
            return None
        return stall_verdict(where, [r for r in running if r not in where])

    def _waits_in(self, rank: int) -> str:
        where = self._where.get(rank)
        if where is not None and where.current is not None:
            return f"in {call_words(where.current)}"
        return f"to join at {where.rendezvous}" if where is not None and where.rendezvous else "in a collective"

    def _step_time(self) -> float | None:
        rates = [rate for view in self.state.ranks.values() if (rate := view.step_rate)]
        return 1.0 / min(rates) if rates else None

    def _check_stall(self) -> None:
        """No rank progressed for `stall` s: say once where each is and whom the others wait for.
        The run goes on (interrupt, `timeout=` or pdb on live ranks take it from there)."""
        after = stall_after(self.stall, self._step_time())
        now = time.monotonic()
        if after is None or self._stall_said or now - self.state.started < after or now < self._stall_probe:
            return
        running = self.state.unfinished()
        if not running or any(self.state.ranks[r].status != "running" for r in running):
            return  # still starting: that is start_timeout's
        where = self.ask_where(running)
        if where and min(w.idle for w in where.values()) < after:
            # A rank progressed within the window: ask again when the stall would be due if none
            # progresses from now on (so it is said within `stall` s, not twice that), never in a loop.
            self._stall_probe = time.monotonic() + max(after - min(w.idle for w in where.values()), STALL_RECHECK)
            return
        verdict = stall_verdict(where, [r for r in running if r not in where])
        quiet = min((w.idle for w in where.values()), default=after)
        self._stall_said = True  # said once per command
        self.state.set_stall(verdict.text)
        self.display.note(f"No rank has progressed for {quiet:.0f} s: {verdict.text} The run goes on: interrupt it "
                          f"to stop it (stall= sets when this is said; timeout= ends a run).")

    def _check_early_exit(self) -> None:
        """A rank that ended while another waits for it in a collective: that wait never ends."""
        ended = self.state.ended_ranks()
        running = [r for r in self.state.unfinished() if self.state.ranks[r].status == "running"]
        now = time.monotonic()
        if not ended or not running or now - self._probed < PROBE_INTERVAL:
            return
        first_end = min(self.state.ranks[r].ended_at or now for r in ended)
        if now - first_end < EARLY_EXIT_AFTER:
            return
        self._probed = now
        stacks = self.collect_stacks(running)
        # Where each waits: the collective it reported (DDP's gradient all-reduce too, which no
        # Python frame shows), else the torch.distributed call its stack is in.
        where = self.ask_where(running)
        calls: dict[int, tuple | str | None] = {}
        for rank in running:
            current = where[rank].current if rank in where else None
            wait = current or blocked_on_peers(stacks.get(rank, ""))
            seen, count = self._probes.get(rank, (None, 0))
            self._probes[rank] = (wait, count + 1 if wait and wait == seen else 1 if wait else 0)
            calls[rank] = wait
        waiting = [r for r in running if self._probes[r][1] >= EARLY_EXIT_PROBES]
        if not waiting or not self.state.unfinished():
            return
        culprit = min(ended, key=lambda r: self.state.ranks[r].ended_at or now)
        view = self.state.ranks[culprit]
        peers = [facts(where[r]) for r in waiting if r in where and backward_of(where[r].current)]
        summary = ended_verdict(culprit, view.ended_where or "finished", {r: calls[r] for r in waiting},
                                self._backwards_ran(culprit), self._facts(culprit), peers)
        text = "\n\n".join([f"--- rank {culprit}: {view.ended_where or 'finished'} ---",
                            *(f"--- rank {r} stack (waiting) ---\n{stacks.get(r, '')}" for r in waiting)])
        self.state.fail(culprit, summary, text, crashed=True, ended_early=True)
        for r in waiting:
            wait = calls[r]
            self.state.stop(r, f"waiting for rank {culprit} in {call_words(wait) if isinstance(wait, tuple) else wait}")
        self.pool.stuck(waiting, summary)

    def _blame_early_end(self) -> None:
        """Only lost peers, and a rank had already ended: that rank left the others waiting. Said by
        where each waited (the collective it began last), not by the backend's socket error."""
        ended = self.state.ended_ranks()
        if not (self.state.only_lost_peers() and ended):
            return
        culprit = min(ended, key=lambda r: self.state.ranks[r].ended_at or 0.0)
        where = self.state.ranks[culprit].ended_where or "finished"
        waits = {f.rank: self._last_call(f.rank) for f in self.state.failures}
        peers = [self._facts(r) for r, call in waits.items() if backward_of(call)]
        summary = ended_verdict(culprit, where, waits, self._backwards_ran(culprit), self._facts(culprit), peers)
        self.state.fail(culprit, summary, f"--- rank {culprit}: {where} ---", crashed=True, ended_early=True)
        for rank, call in waits.items():  # each one's line says where it waited, as a stopped rank's
            if call is not None:
                self.state.ranks[rank].reason = f"waiting for rank {culprit} in {call_words(call)}"

    def _last_call(self, rank: int) -> tuple | None:
        """The collective a rank began last (where it waited when its peer went away), if it reported it."""
        times = self.state.step_times.get(rank)
        return times.recent[-1] if times is not None and times.recent else None

    def _facts(self, rank: int) -> tuple:
        """A rank's DDP forwards as it last reported them (doctor.facts), () when it did not."""
        times = self.state.step_times.get(rank)
        return facts(times) if times is not None and times.ddp else ()

    def _say_waits(self) -> None:
        """Ranks whose only error is the lost peer (gloo's socket error) read as waiting for the
        rank that failed, in the collective they began last, as ranks stopped in a wait do."""
        cause = self.state.root_cause()
        if cause.lost_peer:
            return
        for failure in self.state.failures:
            said = self.waiting_words(failure.rank, cause.rank) if failure.lost_peer else ""
            if said:
                self.state.ranks[failure.rank].reason = said

    def waiting_words(self, rank: int, culprit: int) -> str:
        """'waiting for rank 1 in all_reduce #2 ...' for a rank stopped (or cut off) in a wait: in the
        later of the collective it reported last and the one it was in when last asked; '' if neither."""
        where = self._where.get(rank)
        calls = [c for c in (self._last_call(rank), where.current if where is not None else None) if c is not None]
        return f"waiting for rank {culprit} in {call_words(max(calls, key=lambda c: c[0]))}" if calls else ""

    def _say_mismatched(self, calls: dict[int, tuple], culprit: int) -> None:
        """The other ranks' errors in the collective that does not match are its consequences (gloo's
        socket errors, its size checks): each reads as where it was, the same words for every rank."""
        for rank, call in calls.items():
            view = self.state.ranks.get(rank)
            if rank != culprit and view is not None and view.status in ("stopped", "failed"):
                seq, op, _shape, _dtype, *place = call
                view.status, view.detail = "stopped", f"stopped (rank {culprit} failed)"
                view.reason = f"in {call_words((seq, op, None, None, *place))}, the collective that does not match"

    def _backwards_ran(self, rank: int) -> int | None:
        """The backward() calls whose gradients DDP all-reduced on `rank`, by its last reported bucket."""
        times = self.state.step_times.get(rank)
        ran = [b for call in (times.recent if times else ()) if (b := backward_of(call))]
        return ran[-1] if ran else (0 if times is not None else None)

    def _mismatch(self) -> str | None:
        """Collectives that do not match across ranks, from the calls they reported and the ones they wait in."""
        recent = {r: list(t.recent) for r, t in self.state.step_times.items()}
        for rank, where in self._where.items():
            if where.current is not None:
                recent.setdefault(rank, []).append(where.current)
        calls = mismatched_calls(recent)
        found = mismatch_words(calls)
        cause = self.state.root_cause()
        if calls is not None:
            self._say_mismatched(calls, cause.rank)
        aborted = cause.crashed and "SIGABRT" in cause.summary  # how gloo ends a rank on a size mismatch
        died_in = blocked_on_peers(cause.traceback) if aborted else None
        said = exception_message(cause.traceback) if aborted and not died_in else None
        if found or not (died_in or (said and BACKEND_MISMATCH.search(said))):
            return found
        # A rank killed by the backend inside a collective (gloo aborts on a size mismatch); the
        # others' record of the call may not have come (they were stopped first on a busy machine).
        # Without its stack (a terminate handler that silenced faulthandler), the backend's words say it.
        last = each_call({r: c[-1] for r, c in recent.items() if c})
        reported = f"; the last collectives the ranks reported: {last}" if last else ""
        how = f"died inside {died_in}" if died_in else f'was ended by the backend inside a collective ("{said}")'
        return (f"rank {cause.rank} {how}{reported}. A collective whose tensors differ across "
                "ranks kills the backend: compare their shapes and dtypes on every rank.")
