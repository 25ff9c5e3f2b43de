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
import time

from ...common import protocol
from ...common.errors import WorkerError, interrupt_report
from ...common.tracebacks import name_cells_in_pdb
from ...common.transfer import unpack_exception
from ...common.words import ranks_words
from ...display.rank_output import KINDS as RANK_OUTPUT
from ...display.rank_output import deliver
from .hang_checks import HangChecks
from .runmodel import RunState
from .stacks import native_note, tidy_stacks
from .stalled import keep_stalled
from .watched import Watched

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
# What gloo says when it aborts a rank in a collective whose sizes differ across ranks.

CONNECTION_CLOSED = ("its connection to the notebook closed (its process exited or was killed, or its machine "
                     "went away)")
NOT_SENT = "the command was not sent"  # a rank's reason, when Ctrl-C came before its command went out


class Supervisor(HangChecks):
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
        self._stuck: list[int] = []  # a launch's ranks still running at its timeout, the one to blame first

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
            kept = self._keep_after_stall() if self._stall_said else None
            if kept is not None:  # a launch that stalled, interrupted: its ranks stay for %debug, as at a timeout
                report = [f"KeyboardInterrupt: interrupted after the stall said above. {kept.how()}"]
                interrupt.debug = kept.debug  # type: ignore[attr-defined]
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
        # As they were at the time-out: the stacks take a second or two, while which a rank still
        # starting may connect, even return; it could not have answered, and the report says so.
        status = {r: v.status for r, v in self.state.ranks.items()}
        done = [r for r, v in status.items() if v == "finished"]
        stacks = self.collect_stacks(running)
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
            python = stacks.get(r) or _no_stack(status[r])
            shown.append(f"--- rank {r} stack{role} ---\n{python}{folded}")
            self._stacks[r] = f"{python}{whole}"
        self._stuck = order if only is None else []
        self.state.fail(order[0], summary, "\n\n".join(shown))
        for r in order[1:]:
            if r in waiting and culprits:
                self.state.stop(r, f"waiting for {ranks_words(culprits)} {self._waits_in(r)}")
            else:
                self.state.fail(r, why)
        self.pool.stuck(running, summary)

    def _keep_after_stall(self):
        """A launch's ranks still stuck when Ctrl-C came after the stall note, kept for %debug (the
        one the others wait for first), or None where they are not kept (`stalled.keep_stalled`)."""
        running = self.state.unfinished()
        if self.pool.live or not running:
            return None
        verdict = self._diagnose(running)
        culprits = [r for r in verdict.culprits if r in running] if verdict else []
        return keep_stalled(self.pool, culprits + [r for r in running if r not in culprits])

    # -- the doctor ----------------------------------------------------------------------
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
            culprit = self.state.root_cause().rank
            for rank in self.state.unfinished():  # stopped before their own (lost peer) error came
                self.state.stop(rank, self.waiting_words(rank, culprit))
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
        disagree = self._mismatch()  # first: it says the others' part in a mismatch
        others = tuple(self.state.outcome_lines(cause))
        note = self.pool.restart_note()
        summary = cause.summary + (f"\n{note}" if note else "")
        if disagree:  # what the ranks' errors ("Connection closed by peer") do not say
            summary = f"{disagree}\n{summary}"
        node = self.state.ranks[cause.rank].host if self.pool.remote else None  # named where ranks are elsewhere
        kept = keep_stalled(self.pool, self._stuck) if self._stuck else None
        if kept is not None:
            summary += f"\n{kept.how()}"
        error = WorkerError.from_failure(cause.rank, summary, cause.traceback, others,
                                         original=unpack_exception(cause.exception), node=node, stacks=self._stacks)
        if kept is not None:
            error.debug = kept.debug  # type: ignore[attr-defined]  # `%debug` opens the stuck rank's frames
        return error

def _no_stack(status: str) -> str:
    """What stands for a rank's stack when it sent none: one still starting (importing, or not
    yet connected to the notebook) cannot answer, which says more than a silence."""
    if status == "starting":
        return "(no stack: the rank was still starting: it had not reached the notebook yet)"
    return "(no stack: the rank did not answer)"
