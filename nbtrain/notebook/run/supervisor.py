"""The notebook side of one command on the ranks: watch until every rank replied or one failed.

Runs on the kernel's main thread, so Ctrl-C reaches it and output lands in the running cell.
What happens after a failure depends on the pool: a launch's ranks are stopped (the pool is
closed by the caller); live ranks are interrupted and keep their state, and only ranks that
cannot be interrupted (stuck in C code or a collective) are diagnosed by their stacks and the
pool restarted. A wait that can never complete — a rank ended while another waits for it in
a collective — is recognised from the waiting rank's stack within seconds, not left to hang.

The supervisor keeps no state of the pool's: it asks the pool (`Watched`, what `Pool` offers it)
and tells the run's model (`RunState`) what it finds; the stacks are read by `stacks.py`.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Protocol

from ...common import protocol
from ...common.errors import WorkerError, interrupt_report
from ...common.tracebacks import name_cells_in_pdb
from ...common.transfer import unpack_exception
from ...display.rank_output import KINDS as RANK_OUTPUT
from ...display.rank_output import deliver
from .doctor import Verdict, backward_of, call_words, ended_verdict, facts, mismatch, stall_after, stall_verdict
from .runmodel import RunState
from .stacks import blocked_on_peers, exception_message, native_note, tidy_stacks

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between checks of the processes
OUTPUT_WAIT = 2.0  # live ranks that replied: how long their last output may take to follow
SETTLING = (protocol.Returned, protocol.Raised, protocol.Closed)
EXIT_DRAIN = 1.0  # after a process exits, how long its last messages may take to arrive
LAST_WORDS_WAIT = 5.0  # ... and what it wrote on its own pipes, left unread, may take to be read
PEER_ERRORS = 0.3  # after a failure, how long to listen for the others' before naming the cause
CULPRIT_WAIT = 5.0  # when every failure so far is a lost peer: how long to wait for the rank that was lost
INTERRUPT_GRACE = 2.0  # live ranks: how long an interrupted rank may take to return
STACK_WAIT = 1.0  # for faulthandler's dumps after asking for them
STACK_QUIET = 0.15  # a dump is complete once its rank has been silent this long
EARLY_EXIT_AFTER = 1.0  # a rank ended this long ago while others still run: look at where they wait
EARLY_EXIT_PROBES = 2  # consecutive stacks showing the same wait before it counts as a deadlock
PROBE_INTERVAL = 1.0
WHERE_WAIT = 1.0  # for the ranks' answers to `Where`: a rank holding the GIL in C code does not answer
STALL_RECHECK = 0.25  # the least time between two questions to the ranks about a stall
# What gloo says when it aborts a rank in a collective whose sizes differ across ranks.
BACKEND_MISMATCH = re.compile(r"collective mismatch|doesn't match expected size")

CONNECTION_CLOSED = ("its connection to the notebook closed (its process exited or was killed, or its machine "
                     "went away)")
NOT_SENT = "the command was not sent"  # a rank's reason, when Ctrl-C came before its command went out


class Watched(Protocol):
    """What a Supervisor asks of the pool whose command it watches (`pool.Pool` offers it)."""

    # Read-only: the supervisor asks, the pool alone changes them.
    @property
    def live(self) -> bool: ...  # live ranks: interrupted and kept, never stopped for another's failure
    @property
    def remote(self) -> bool: ...  # the ranks run elsewhere: no pids to signal, no py-spy
    @property
    def processes(self) -> tuple: ...  # the rank processes' handles (`placements.base`)
    @property
    def ended_by(self) -> str | None: ...  # who closed the pool under this command ("restarted by .restart()")
    @property
    def broken(self) -> str | None: ...  # why the live ranks take no more work
    @property
    def restart_reason(self) -> str | None: ...  # why the live ranks will be restarted

    def receive(self, timeout: float): ...  # the next message (the pool noted it), or None
    def process_of(self, rank: int): ...
    def closed(self, rank: int) -> bool: ...  # its link closed
    def output_unread(self, rank: int) -> bool: ...  # its last words wait in a pipe only it writes
    def closed_ranks(self) -> list[int]: ...
    def began(self, rank: int) -> bool: ...  # it began this command: its words are about it
    def output_done(self, rank: int) -> bool: ...  # all it printed during this command has come
    def shows(self, output) -> bool: ...  # an output line goes to the cell
    def last_words(self, rank: int) -> str: ...  # what a crashed rank said last
    def answer(self, message, display) -> None: ...  # a Need or a Prompt
    def interrupt(self, ranks: list[int]) -> None: ...
    def ask_stacks(self, pids: dict[int, int | None]) -> None: ...
    def ask_where(self, ranks: list[int]) -> None: ...  # each answers `Whereabouts`
    @property
    def stall(self) -> float | bool | None: ...  # the run's `stall=` (doctor.stall_after)
    def lost(self, proc, code: int, how: str | None = None) -> None: ...  # a rank's process ended
    def stuck(self, ranks: list[int], why: str) -> None: ...  # ranks an interrupt did not free
    def restart_note(self) -> str: ...
    def any_alive(self) -> bool: ...


class Supervisor:
    """Watches the ranks of `state` for one command of `pool`."""

    def __init__(self, pool: Watched, state: RunState, display, timeout: float | None,
                 start_timeout: float | None = None,
                 interrupt: KeyboardInterrupt | None = None):
        self.pool = pool
        self.interrupt = interrupt  # a Ctrl-C that came while the command was being sent
        self.state = state
        self.display = display
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._capturing: dict[int, list[str]] | None = None  # stacks being collected
        self._heard: dict[int, float] = {}
        self._probes: dict[int, tuple[tuple | str | None, int]] = {}  # rank: (the wait seen, times in a row)
        self._probed = 0.0
        self._closed_at: dict[int, float] = {}  # remote ranks whose connection closed without a reply
        self._queued = 0.0  # seconds the ranks waited in an engine's queue (not counted by timeouts)
        self._queued_since: float | None = None
        self._placement_line = ""  # the engine's latest word on where the ranks are (a SLURM job's state)
        self._interrupted_at: dict[int, str] = {}  # rank: its traceback when our interrupt reached it
        self.stall = pool.stall
        self._where: dict[int, protocol.Whereabouts] = {}  # the ranks' latest answers to `Where`
        self._stall_probe = 0.0  # when the doctor may next ask where the ranks are
        self._stall_said = False
        self._stacks: dict[int, str] = {}  # every rank's full stacks, once read for a failure (`error.stacks`)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Return when every rank replied; raise WorkerError or KeyboardInterrupt otherwise."""
        try:
            if self.interrupt is not None:
                raise self.interrupt
            while self.state.unfinished() and not self.state.failures:
                self._pump(TICK, until_settled=True)
                self._check_processes()
                self._check_placement()
                self._check_deadlines()
                self._check_early_exit()
                self._check_stall()
                self.display.update(self.state)
            if self.state.failures:
                self._settle_failure()
                self._await_output()
                raise self._worker_error()
            self._await_output()
        except KeyboardInterrupt as interrupt:
            stuck = self._on_kernel_interrupt()
            # IPython shows this instead of nbtrain's own frames: where the ranks were is what the user needs.
            serving = self.pool.live and self.start_timeout is None  # not still starting (then they stop)
            report = interrupt_report(serving, list(self.state.ranks), self._interrupted_at, stuck,
                                      self.pool.restart_reason)
            unsent = [r for r, v in self.state.ranks.items() if v.reason.startswith(NOT_SENT)]
            if unsent and serving:
                report.insert(1, f"(Ctrl-C came while the command was being sent: ranks {unsent} never had it.)")
            interrupt._render_traceback_ = lambda: report  # type: ignore[attr-defined]  # IPython's hook
            raise
        finally:
            self.state.ended = time.monotonic()

    def _pump(self, timeout: float, until_settled: bool = False) -> None:
        """Handle messages for up to `timeout` s; with `until_settled`, return as soon as one
        may have ended the command (a result, an error, a closed channel), so no tick is wasted."""
        deadline = time.monotonic() + timeout
        while (message := self.pool.receive(deadline - time.monotonic())) is not None:
            self._handle(message)
            if until_settled and isinstance(message, SETTLING):
                return

    def _handle(self, message) -> None:
        """One message (the pool has noted what it keeps of it: closed links, end marks, begun commands)."""
        rank, pool = message.rank, self.pool
        if isinstance(message, (protocol.Closed, protocol.OutputEnd, protocol.Begin)):
            return
        if isinstance(message, protocol.Whereabouts):
            self._where[rank] = message
            return
        if isinstance(message, protocol.Output):
            stream, text = message.stream, message.text
            if stream == "debug":  # pdb on a rank talking to the user: untagged, cells named as IPython names them
                print(name_cells_in_pdb(text), flush=True)
            elif self._capturing is not None and rank in self._capturing and stream == "stderr":
                self._capturing[rank].append(text)
                self._heard[rank] = time.monotonic()
            elif pool.shows(message):
                self.display.output(rank, stream, text)
        elif isinstance(message, RANK_OUTPUT):  # lines a bar redraws, rich display
            deliver(self.display, message)
        elif isinstance(message, protocol.Hello):
            self.state.handle(message)
        elif not pool.began(rank):
            return  # a late word about an earlier command
        elif isinstance(message, (protocol.Need, protocol.Prompt)):
            pool.answer(message, self.display)
        elif isinstance(message, protocol.Raised) and rank in self.state.interrupted \
                and message.summary.startswith("KeyboardInterrupt"):
            self._interrupted_at[rank] = message.traceback
            self.state.stop(rank)  # interrupted by us, because another rank failed or time ran out
        elif isinstance(message, protocol.Raised) and message.summary.startswith("SystemExit") \
                and (gone := self._engine_gone()) is not None:
            # Ray ends its workers with SIGTERM, and its handler raises SystemExit in the user's
            # code: that the engine went away is the cause, told as when no reply came.
            self.state.fail(rank, f"rank {rank} was lost with Ray: {gone}", message.traceback, crashed=True)
        else:
            self.state.handle(message)

    def _engine_gone(self) -> str | None:
        return next((why for proc in self.pool.processes if (why := proc.engine_gone()) is not None), None)

    def _await_output(self) -> None:
        """Live ranks that replied: wait (bounded) for the mark that ends their output, so
        what they printed lands in this cell and not in the next one."""
        if not self.pool.live:
            return  # a launch's ranks end: their pipes' end of file says the same
        deadline = time.monotonic() + OUTPUT_WAIT
        replied = [r for r, v in self.state.ranks.items() if v.status in ("finished", "failed", "stopped")
                   and self.pool.began(r) and not self.pool.closed(r)]
        while (left := deadline - time.monotonic()) > 0 and not all(self.pool.output_done(r) for r in replied):
            if (message := self.pool.receive(left)) is not None:  # done as the last mark comes, not at a window's end
                self._handle(message)

    # -- failures ------------------------------------------------------------------------
    def _check_processes(self) -> None:
        now = time.monotonic()
        for proc in self.pool.processes:
            code = proc.poll()
            if code is None:
                continue
            proc.exited_at = proc.exited_at or now
            missing = self._missing(proc)
            drained = all(self.pool.closed(r) for r in missing)
            waited = now - proc.exited_at
            if not missing or (not drained and waited < EXIT_DRAIN):
                continue  # its own result or error report may still be on the way
            if waited < LAST_WORDS_WAIT and any(self.pool.output_unread(r) for r in missing):
                continue  # its last words (faulthandler's, C++'s) are in its pipe: a busy machine reads late
            self._pump(0)  # what the reader passed on last
            for r in self._missing(proc):
                summary, crashed = proc.exit_reason(r, code, self.state.ranks[r].pid or proc.pid)
                if self.pool.ended_by:  # closed under this command, by another thread
                    summary = f"the live ranks were {self.pool.ended_by} while this command ran ({summary})"
                if crashed:
                    self.state.fail(r, summary, self.pool.last_words(r), crashed=True)
                else:
                    self.state.stop(r, summary)
            self.pool.lost(proc, code)
        if self.pool.remote:
            self._check_connections(now)

    def _missing(self, proc) -> list[int]:
        """`proc`'s ranks that have neither replied nor been stopped."""
        ranks = self.state.ranks
        return [r for r in proc.ranks if r in ranks and ranks[r].status in ("starting", "running")]

    def _check_connections(self, now: float) -> None:
        """A remote rank whose connection closed without a reply has ended: its process is the
        engine's, not ours to watch (one SLURM task of several can die while the job runs)."""
        for rank in self.pool.closed_ranks():
            view = self.state.ranks.get(rank)
            if view is None or view.status not in ("starting", "running"):
                continue
            if now - self._closed_at.setdefault(rank, now) < EXIT_DRAIN:
                continue  # its reply may still be on the way
            proc = self.pool.process_of(rank)
            how = (proc.lost_reason(rank) if proc is not None else None) or CONNECTION_CLOSED
            self.state.fail(rank, f"rank {rank} ended without a reply: {how}", self.pool.last_words(rank),
                            crashed=True)
            if proc is not None:
                self.pool.lost(proc, 1, how)

    def _check_placement(self) -> None:
        """Say where an engine holds the ranks (a SLURM job's queue state), and stop the clocks
        while they wait there: queue time is not a stall."""
        waiting = False
        for proc in self.pool.processes:
            status = proc.status()
            if status is None:
                continue
            line, queued = status
            waiting = waiting or queued
            if line:  # a new line only: the process says each once
                self.display.note(line)
                self._placement_line = line
        held = (self._placement_line or "the cluster places the ranks") if waiting else None
        self.state.set_queued(held)  # a submitted run's status reads "queued" while this is set
        now = time.monotonic()
        if waiting and self._queued_since is None:
            self._queued_since = now
        elif not waiting and self._queued_since is not None:
            self._queued += now - self._queued_since
            self._queued_since = None

    def _running_time(self) -> float:
        """Seconds since the command began, less the time its ranks waited in a queue."""
        waiting = time.monotonic() - self._queued_since if self._queued_since is not None else 0.0
        return self.state.elapsed - self._queued - waiting

    def _check_deadlines(self) -> None:
        elapsed = self._running_time()
        if self.timeout is not None and elapsed > self.timeout:
            self._time_out(f"timed out after {self.timeout:g} s")
        elif self.start_timeout is not None and elapsed > self.start_timeout:
            silent = [r for r, v in self.state.ranks.items() if v.status == "starting"]
            if silent:
                self._time_out(f"did not start within {self.start_timeout:g} s", only=silent)

    def _time_out(self, why: str, only: list[int] | None = None) -> None:
        running = only or self.state.unfinished()
        # Where they are first (before an interrupt moves them): the rank the others wait for is the one to blame.
        verdict = self._diagnose(running) if only is None else None
        if self.pool.live and only is None:
            # Interrupted ranks keep their state; only those that do not return are diagnosed.
            interrupted = running
            running = self._interrupt(running)
            if not running:  # every rank returned: their state is kept
                said = f"\n{verdict.text}" if verdict else ""
                self.state.fail(min(interrupted), f"{why}; ranks {interrupted} were interrupted (their state is kept)"
                                + said, even_if_stopped=True)
                return
        stacks = self.collect_stacks(running)
        done = [r for r, v in self.state.ranks.items() if v.status == "finished"]
        summary = f"{why}; still running: ranks {running}" + (f"; finished: ranks {done}" if done else "")
        culprits = [r for r in verdict.culprits if r in running] if verdict else []
        waiting = [r for r in verdict.waiting if r in running and r not in culprits] if verdict else []
        if verdict:
            summary += f"\n{verdict.text}"
        order = culprits + [r for r in running if r not in culprits]
        shown = []
        for r in order:
            folded, whole = native_note(r, self.state.ranks[r].pid, self.pool.remote)
            role = " (waiting)" if r in waiting else ""
            python = stacks.get(r) or _no_stack(self.state.ranks[r].status)
            shown.append(f"--- rank {r} stack{role} ---\n{python}{folded}")
            self._stacks[r] = f"{python}{whole}"
        self.state.fail(order[0], summary, "\n\n".join(shown))
        for r in order[1:]:
            if r in waiting and culprits:
                self.state.stop(r, f"waiting for {_ranks(culprits)} {self._waits_in(r)}")
            else:
                self.state.fail(r, why)
        self.pool.stuck(running, summary)

    # -- the doctor ----------------------------------------------------------------------
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

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every listed rank's Python stacks (faulthandler), before anything is stopped."""
        self._capturing = {r: [] for r in ranks}
        self._heard = {}
        self.pool.ask_stacks({r: self.state.ranks[r].pid for r in ranks})
        started = time.monotonic()
        while time.monotonic() - started < STACK_WAIT:
            self._pump(0.05)
            quiet = time.monotonic() - STACK_QUIET
            if self._heard and all(self._heard.get(r, started + STACK_WAIT) < quiet for r in ranks):
                break
        captured, self._capturing = self._capturing, None
        return {r: tidy_stacks("\n".join(lines)) for r, lines in captured.items()}

    def _settle_failure(self) -> None:
        """Hear the other ranks, make sure the right one is blamed, and bring the rest to rest."""
        self._pump(PEER_ERRORS)
        self._check_processes()
        deadline = time.monotonic() + CULPRIT_WAIT
        # Errors about a lost peer are consequences; the peer that was lost is the cause.
        while self.state.only_lost_peers() and time.monotonic() < deadline and self.pool.any_alive():
            self._pump(TICK)
            self._check_processes()
        self._blame_early_end()
        self._say_waits()
        if not self.pool.live or self.pool.broken:  # the caller stops these ranks now: say so
            for rank in self.state.unfinished():
                self.state.stop(rank)
            return
        # Live ranks keep their state: interrupt the others; only those that cannot return are diagnosed.
        running = [r for r in self.state.unfinished() if self.state.ranks[r].status == "running"]
        stuck = self._interrupt(running) if running else []
        if stuck:
            stacks = self.collect_stacks(stuck)
            cause = self.state.root_cause()
            for r in stuck:
                self.state.stop(r, f"did not return after an interrupt (rank {cause.rank} failed)",
                                stack=stacks.get(r, ""))
            self.pool.stuck(stuck, f"rank {cause.rank} failed")

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
            call = self._last_call(failure.rank) if failure.lost_peer else None
            if call is not None:
                self.state.ranks[failure.rank].reason = f"waiting for rank {cause.rank} in {call_words(call)}"

    def _backwards_ran(self, rank: int) -> int | None:
        """The backward() calls whose gradients DDP all-reduced on `rank`, by its last reported bucket."""
        times = self.state.step_times.get(rank)
        ran = [b for call in (times.recent if times else ()) if (b := backward_of(call))]
        return ran[-1] if ran else (0 if times is not None else None)

    def _interrupt(self, ranks: list[int]) -> list[int]:
        """Interrupt live ranks and wait for them to return; the ranks that did not."""
        self.state.interrupted.update(ranks)
        self.pool.interrupt(ranks)
        deadline = time.monotonic() + INTERRUPT_GRACE
        while time.monotonic() < deadline and any(r in self.state.unfinished() for r in ranks):
            self._pump(TICK)
            self._check_processes()
        return [r for r in ranks if r in self.state.unfinished()]

    def _on_kernel_interrupt(self) -> list[int]:
        """Interrupt live ranks; the ranks that did not return (restarted)."""
        if not self.pool.live:
            return []  # the caller stops a launch's ranks
        stuck = []
        try:
            running = [r for r in self.state.unfinished()]
            stuck = self._interrupt(running) if running else []
            if stuck:
                stacks = self.collect_stacks(stuck)
                why = f"interrupted, and ranks {stuck} did not return"
                self.display.note(why + ":\n" + "\n\n".join(f"--- rank {r} ---\n{stacks.get(r, '')}" for r in stuck))
                self.pool.stuck(stuck, why)
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, restart
            stuck = self.state.unfinished()
            self.pool.stuck(stuck, "interrupted twice")
        return stuck

    def _worker_error(self) -> WorkerError:
        cause = self.state.root_cause()
        others = tuple(self.state.outcome_lines(cause))
        note = self.pool.restart_note()
        summary = cause.summary + (f"\n{note}" if note else "")
        disagree = self._mismatch()
        if disagree:  # what the ranks' errors ("Connection closed by peer") do not say
            summary = f"{disagree}\n{summary}"
        node = self.state.ranks[cause.rank].host if self.pool.remote else None  # named where ranks are elsewhere
        return WorkerError.from_failure(cause.rank, summary, cause.traceback, others,
                                        original=unpack_exception(cause.exception), node=node, stacks=self._stacks)

    def _mismatch(self) -> str | None:
        """Collectives that do not match across ranks, from the calls they reported and the ones they wait in."""
        recent = {r: list(t.recent) for r, t in self.state.step_times.items()}
        for rank, where in self._where.items():
            if where.current is not None:
                recent.setdefault(rank, []).append(where.current)
        found = mismatch(recent)
        cause = self.state.root_cause()
        aborted = cause.crashed and "SIGABRT" in cause.summary  # how gloo ends a rank on a size mismatch
        died_in = blocked_on_peers(cause.traceback) if aborted else None
        said = exception_message(cause.traceback) if aborted and not died_in else None
        if found or not (died_in or (said and BACKEND_MISMATCH.search(said))):
            return found
        # A rank killed by the backend inside a collective (gloo aborts on a size mismatch); the
        # others' record of the call may not have come (they were stopped first on a busy machine).
        # Without its stack (a terminate handler that silenced faulthandler), the backend's words say it.
        calls = "; ".join(f"rank {r}: {call_words(c[-1])}" for r, c in sorted(recent.items()) if c)
        reported = f"; the last collectives the ranks reported: {calls}" if calls else ""
        how = f"died inside {died_in}" if died_in else f'was ended by the backend inside a collective ("{said}")'
        return (f"rank {cause.rank} {how}{reported}. A collective whose tensors differ across "
                "ranks kills the backend: compare their shapes and dtypes on every rank.")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _no_stack(status: str) -> str:
    """What stands for a rank's stack when it sent none: one still starting (importing, or not
    yet connected to the notebook) cannot answer, which says more than a silence."""
    if status == "starting":
        return "(no stack: the rank was still starting: it had not reached the notebook yet)"
    return "(no stack: the rank did not answer)"
