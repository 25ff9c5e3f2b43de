"""Rank processes started once, and the commands run on them: what `launch` and `Ranks` share.

A pool is one placement's processes (forked, spawned, template-forked, torchrun, remote), the
channel to them and their output. `launch` is a pool whose ranks run one `Run` command and
exit; live `Ranks` keep theirs and send command after command. Each command is watched by a
`Supervisor` into a `RunState`, shown by a display, and fails with the same `WorkerError`.

The pool's state is its own: what it keeps of the ranks' messages is noted as each message is
taken from the inbox, by whoever takes it (`rank_notes.py`); what the ranks ask of the notebook
is answered by `rank_asks.py`; its processes are ended by `rank_exits.py`. The supervisor asks
for what it needs through the methods under "what the supervisor asks" (`watched.Watched`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time

from ...common import protocol
from ...common.channel import Hub, SendInterrupted
from ...common.errors import NbtrainError
from ...common.limits import out_of_files
from ...common.output_reader import OutputReader
from ...common.tensor_files import LaunchFiles
from ...display.rank_output import KINDS as RANK_OUTPUT
from ...display.rank_output import deliver
from ...placements.base import describe_exit
from ...rank.process import STACKS_SIGNAL
from .debugger import DebugPort, breakpoints_environ
from .rank_asks import RankAsks
from .rank_exits import any_alive, stop_processes, wait_exits
from .rank_notes import RankNotes
from .runmodel import RunState
from .supervisor import CONNECTION_CLOSED, NOT_SENT, Supervisor

EXIT_WAIT = 5.0  # ranks that replied: how long they may take to exit on their own
EXIT_NOTE_AFTER = 2.0  # seconds of that wait before the cell says it waits (the view would read "finished")
EXIT_NOTE = "every rank has reported; waiting for their processes to exit"
IDLE_CHECK = 0.25  # live ranks between commands: seconds between looks at their processes and links
EXIT_CODE_WAIT = 1.0  # a rank whose link closed: how long its exit code may take to be known

log = logging.getLogger(__name__)


def _size(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size} bytes"


class PoolBroken(NbtrainError, RuntimeError):
    """The live ranks cannot take work: one died or they were closed. `restart()` them."""


class Pool:
    def __init__(self, launcher, job, live: bool):
        self._launcher, self._job, self._live = launcher, job, live
        # The ranks' debugger messages go to the kernel's debugger (`debugger.py`), the rest to the watcher.
        self._inbox: queue.Queue = DebugPort(self._debuggable, lambda rank, message: self._hub.send(rank, message))
        made: list = []  # what holds descriptors, closed again when a later part cannot be made
        step = "opening the ranks' channel"
        try:
            self._hub: Hub = Hub(self._inbox, **launcher.channel_options(job))
            made.append(self._hub.close)
            step = "preparing to read the ranks' output"
            self._reader = OutputReader(self._inbox.put)
            made.append(self._reader.close)
            step = "preparing shared memory for returned tensors"
            # Large returned tensors come through files this machine shares with its ranks (a remote
            # rank on another machine sends bytes instead: see clusters.base.here).
            self._files = LaunchFiles()
        except OSError as exc:
            for close in reversed(made):
                close()
            raise out_of_files(exc, step, len(job.ranks)) from exc
        self._processes: list = []
        self._notes = RankNotes()  # what the pool keeps of the ranks' messages (`_take`)
        self._asks = RankAsks(lambda rank, message: self._hub.send(rank, message))
        self._pids: dict[int, int | None] = {}
        self._hosts: dict[int, str | None] = {}
        self._seq = 0
        self._broken: str | None = None  # why the pool refuses work
        self._restart_reason: str | None = None  # ranks stuck beyond an interrupt: the pool must restart
        self._ended_by: str | None = None  # "restarted by .restart()": who closed the pool, for a command it ends
        self._stopped = False
        self._state: RunState | None = None  # the first command's
        # Live ranks are watched between commands too: a rank that dies then is named at once.
        self._idle = threading.Lock()  # held by a command, and by the watcher while it looks
        self._closing = threading.Event()  # wakes the watcher to end
        self._watcher: threading.Thread | None = None
        self._held: list = []  # messages the watcher took from the inbox, for the next command

    # -- what others read ----------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return self._job.ranks

    @property
    def live(self) -> bool:
        """Live ranks: they serve command after command, and are interrupted rather than stopped."""
        return self._live

    @property
    def remote(self) -> bool:
        """The ranks run elsewhere (a cluster's engine): no pids to signal, no pipes to read here."""
        return self._launcher.remote

    @property
    def state(self) -> RunState | None:
        """The first command's state (a launch's run); None before it started."""
        return self._state

    @property
    def files(self) -> LaunchFiles | None:
        """Where large tensors travel between this machine and its ranks."""
        return self._files

    @property
    def broken(self) -> str | None:
        """Why the live ranks take no more work, or None."""
        return self._broken

    @property
    def restart_reason(self) -> str | None:
        """Why the live ranks must be restarted (ranks stuck beyond an interrupt), or None."""
        return self._restart_reason

    @property
    def ended_by(self) -> str | None:
        """Who closed the pool ("restarted by .restart()"), for a command it ended."""
        return self._ended_by

    def channel_options(self) -> dict:
        """Where a second channel to these ranks listens (a map's work queue): as the run's own."""
        return self._launcher.channel_options(self._job)

    # -- life ----------------------------------------------------------------------------
    def start(self, display, timeout: float | None = None) -> RunState:
        """Start the ranks and watch their first command (`job.first`: a launch's run, or a live
        pool's start-up) to its end; the processes stay until `close`."""
        try:  # what is opened here is closed by `close`, which a failed start is followed by
            step = "making the ranks' rendezvous"
            job = self._job = self._launcher.prepare(self._job, self._live, display, self._hub.adopt)
            state = self._state = RunState(self._title(), job.ranks)
            display.start(state)
            step = "starting the ranks (their output pipes and channels)"
            self._launcher.start_ranks(job, {**self._hub.environ, **(self._files.environ if self._files else {}),
                                             **breakpoints_environ()}, self._reader, self._processes)
        except OSError as exc:
            raise out_of_files(exc, step, len(job.ranks)) from exc
        self._hub.start()
        self._reader.start()
        self._watch(state, display, timeout, job.start_timeout)
        self._pids = {r: v.pid for r, v in state.ranks.items()}
        self._hosts = {r: v.host for r, v in state.ranks.items()}
        if self._live:
            self._watcher = threading.Thread(target=self._watch_idle, name="nbtrain-idle-watch", daemon=True)
            self._watcher.start()
        return state

    def _title(self) -> str:
        return f"{'live ranks' if self._live else self._job.strategy} on {self._job.plan.describe()}"

    def close(self, ok: bool = True, display=None, why: str | None = None, exit_note=None) -> None:
        """Stop the ranks (a launch's have exited on their own when `ok`), drain their output.
        `why` ("restarted by .restart()") is what a command still running (another thread's) is told;
        `exit_note(line)` is told when ranks that reported take seconds to exit."""
        if self._stopped:
            return
        self._stopped = True
        self._ended_by = why
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        try:
            if self._live and self.any_alive():
                for rank in self.ranks:
                    self._hub.send(rank, protocol.Stop())
            if ok or self._live:
                wait_exits(self._processes, self.remote, EXIT_WAIT if ok else 1.0, exit_note if ok else None,
                           EXIT_NOTE_AFTER, EXIT_NOTE)
            stop_processes(self._processes, self.remote)
            self._reader.drain(timeout=1.0)
            self._drain_output(display)
        finally:
            self._hub.close()
            self._reader.close()
            self._launcher.close(self._job)
            if self._files is not None:
                self._files.cleanup()

    def any_alive(self) -> bool:
        return any_alive(self._processes)

    # -- the ranks' messages -------------------------------------------------------------
    def _take(self, timeout: float | None = None):
        """The next message from the inbox (waiting up to `timeout` s), noted; None if none came."""
        try:
            message = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return None
        self._notes.note(message)
        return message

    def _queued(self):
        """The queued messages, oldest first: those the watcher held, then the inbox's."""
        held, self._held = self._held, []
        yield from held
        while (message := self._take()) is not None:
            yield message

    def shows(self, output: protocol.Output) -> bool:
        """Whether a rank's output line goes to the cell (`RankNotes.shows`)."""
        return self._notes.shows(output)

    def _drain_output(self, display, keep: bool = False) -> None:
        """Hand the queued output lines to the display (None: dropped). With `keep`, the other
        messages (but a link's close or an end mark) are queued again: output a live rank wrote
        between commands (a thread of its own, say) goes to the next cell, the rest belongs to
        the command about to start."""
        pending = []
        for message in self._queued():
            if isinstance(message, protocol.Output):
                if display is not None and self.shows(message):
                    display.output(message.rank, message.stream, message.text)
            elif isinstance(message, RANK_OUTPUT):
                if display is not None:
                    deliver(display, message)
            elif keep and not isinstance(message, (protocol.Closed, protocol.OutputEnd)):
                pending.append(message)
        for message in pending:
            self._inbox.put(message)

    # -- commands ------------------------------------------------------------------------
    def command(self, kind: str, *args, ranks: list[int] | None = None, display, timeout: float | None = None,
                namespace: dict | None = None, title: str = "") -> RunState:
        """Run the command `kind` (`protocol.COMMANDS`) on `ranks` (all by default) and watch it to its end."""
        with self._idle:
            return self._command(kind, *args, ranks=ranks, display=display, timeout=timeout, namespace=namespace,
                                 title=title)

    def _command(self, kind: str, *args, ranks, display, timeout, namespace, title) -> RunState:
        self._check_alive()
        if self._broken:
            raise PoolBroken(f"{self._broken.rstrip('.')}. The live ranks take no more work: call .restart() (their "
                             "state is lost) or .close().")
        targets = list(self.ranks if ranks is None else ranks)
        self._seq += 1
        self._asks.begin(namespace)
        state = RunState(title or f"{kind} on live ranks {targets}", targets)
        for rank in targets:
            state.handle(protocol.Hello(rank, self._pids.get(rank), self._hosts.get(rank)))
        self._drain_output(display, keep=True)
        display.start(state)
        ok = False
        try:
            command = protocol.command(kind, self._seq, len(targets) == len(self.ranks), *args)
            interrupt = self._send_command(state, targets, command)
            self._watch(state, display, timeout, None, interrupt)
            ok = True
        finally:
            if self._broken:
                stop_processes(self._processes, self.remote)
            display.finish(state, ok)
        return state

    def _send_command(self, state: RunState, targets: list[int], command) -> KeyboardInterrupt | None:
        """Send `command` to every target; a Ctrl-C meanwhile, returned for the supervisor to
        handle as one that came while the ranks ran: the ranks that have the command are
        interrupted, those that do not are stopped. A message is never half sent (Hub.send)."""
        sent = []
        try:
            for rank in targets:
                if self._hub.send(rank, command):
                    sent.append(rank)
                else:  # it went away since the last look: say how
                    why = self._why_gone(rank, EXIT_CODE_WAIT)
                    state.fail(rank, why, self._fatal_report(rank, idle=False), crashed=True)
                    self._broken = self._broken or why
        except SendInterrupted as interrupt:
            if interrupt.whole:
                sent.append(interrupt.rank)
            else:  # the rank sees its connection close, and ends: only fresh ranks can go on
                why = (f"the link to rank {interrupt.rank} was cut in the middle of a {_size(interrupt.size)} message "
                       f"({interrupt.why})")
                if self._live and not self._broken:
                    self._restart_reason = why
                state.fail(interrupt.rank, why, crashed=True)
            self._not_sent(state, targets, sent)
            return KeyboardInterrupt()  # the notebook's own Ctrl-C, as it shows everywhere else
        except KeyboardInterrupt as interrupt:
            self._not_sent(state, targets, sent)
            return interrupt
        return None

    @staticmethod
    def _not_sent(state: RunState, targets: list[int], sent: list[int]) -> None:
        for rank in targets:
            if rank not in sent:
                state.stop(rank, f"{NOT_SENT}: interrupted")

    def _watch(self, state: RunState, display, timeout, start_timeout, interrupt=None) -> None:
        try:
            Supervisor(self, state, display, timeout, start_timeout, interrupt).run()
        finally:
            state.ended = time.monotonic()

    # -- between commands ----------------------------------------------------------------
    def _watch_idle(self) -> None:
        while not self._closing.wait(IDLE_CHECK) and not self._broken:
            if not self._idle.acquire(blocking=False):
                continue  # a command runs: its supervisor watches the ranks
            try:
                if not self._closing.is_set():
                    self._check_alive(warn=True)
            except Exception:  # closed under it: the next look, or none, says it
                log.debug("idle watch", exc_info=True)
            finally:
                self._idle.release()

    def _check_alive(self, warn: bool = False) -> None:
        """Between commands: a live rank that ended (killed, crashed, its job cancelled) breaks the
        pool, named with its exit code or signal; with `warn`, said at once (logging)."""
        if not self._live or self._broken or self._stopped:
            return
        for rank in self.ranks:
            proc = self.process_of(rank)
            # A remote rank's process is the engine's, slow to ask: its closed connection says it ended.
            ended = not self.remote and proc is not None and proc.poll() is not None
            if ended or not self._hub.connected(rank):
                self._broken = self._why_gone(rank, EXIT_CODE_WAIT)
                if warn:
                    log.warning("nbtrain: %s; the live ranks take no more work until .restart().%s",
                                self._broken.rstrip("."), _indented(self._fatal_report(rank)))
                return

    def _why_gone(self, rank: int, wait: float) -> str:
        """How `rank` ended: its exit code or signal, once known (waiting up to `wait` s)."""
        proc = self.process_of(rank)
        deadline = time.monotonic() + wait
        while proc is not None:
            code = proc.poll()
            if code is not None:
                summary, _ = proc.exit_reason(rank, code, self._pids.get(rank) or proc.pid)
                return f"rank {rank} ended: {summary}"
            lost = proc.lost_reason(rank)  # an engine's word on a rank whose process is not ours
            if lost or time.monotonic() > deadline:
                return f"rank {rank} ended: {lost or CONNECTION_CLOSED}"
            time.sleep(0.05)
        return f"rank {rank} ended: {CONNECTION_CLOSED}"

    def _fatal_report(self, rank: int, idle: bool = True) -> str:
        """faulthandler's report of the fatal signal that ended a rank, if it wrote one; `idle`:
        between commands, when what is queued may be looked through (and is held for the next)."""
        if idle:
            self._reader.drain(timeout=0.2)  # its pipes' last lines
            while (message := self._take()) is not None:
                self._held.append(message)
        return self._notes.fatal_report(rank)

    # -- what the supervisor asks (`watched.Watched`) ---------------------------------------
    def _debuggable(self) -> list[int]:
        """The ranks the kernel's debugger may ask (read from its control thread): none while this
        pool is still being made, its port listed before its channel exists."""
        hub = getattr(self, "_hub", None)
        return [r for r in self.ranks if hub.connected(r)] if hub is not None else []

    def receive(self, timeout: float):
        """The next message from the ranks within `timeout` s (noted by the pool); None if none came.
        OSError: a rank not yet connected cannot be accepted for want of a file descriptor."""
        trouble = self._hub.out_of_files
        if trouble is not None and not all(self._hub.connected(r) for r in self.ranks):
            raise out_of_files(trouble, "accepting the ranks' connections to the notebook", len(self.ranks))
        return self._take(max(timeout, 1e-6))

    @property
    def processes(self) -> tuple:
        """The rank processes' handles (`placements.base`)."""
        return tuple(self._processes)

    def process_of(self, rank: int):
        return next((p for p in self._processes if rank in p.ranks), None)

    def closed(self, rank: int) -> bool:
        """`rank`'s link closed: nothing more comes from it."""
        return self._notes.closed(rank)

    def output_unread(self, rank: int) -> bool:
        """What `rank` wrote on pipes only it writes waits to be read (`OutputReader.unread`)."""
        return self._reader.unread(rank)

    def closed_ranks(self) -> list[int]:
        return self._notes.closed_ranks()

    def began(self, rank: int) -> bool:
        """`rank` began the latest command: what it says now is about that command."""
        return self._notes.began(rank, self._seq)

    def output_done(self, rank: int) -> bool:
        """Everything `rank` printed during the latest command has arrived (both streams' end marks)."""
        return self._notes.output_done(rank, self._seq)

    def last_words(self, rank: int) -> str:
        """What a crashed rank said last (`stacks.last_words`)."""
        return self._notes.last_words(rank)

    def answer(self, message, display) -> None:
        """A rank's `Need` (names its code reads) or `Prompt` (its debugger waits for a line)."""
        self._asks.answer(message, display)

    def interrupt(self, ranks: list[int]) -> None:
        for rank in ranks:
            self._hub.send(rank, protocol.Interrupt(self._seq))

    def ask_where(self, ranks: list[int]) -> None:
        """Every listed rank says where its main thread is (`protocol.Whereabouts`), over the channel."""
        for rank in ranks:
            self._hub.send(rank, protocol.Where())

    @property
    def stall(self):
        """The run's `stall=`: seconds without progress before the doctor looks (None: its default, False: never)."""
        return getattr(self._job, "stall", None)

    def ask_stacks(self, pids: dict[int, int | None]) -> None:
        """Every listed rank writes its threads' stacks on its stderr: by signal (even with the GIL
        held) on this machine, over the channel elsewhere."""
        for rank, pid in pids.items():
            if self.remote or not pid:
                self._hub.send(rank, protocol.Stacks())
                continue
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                pass

    def lost(self, proc, code: int, how: str | None = None) -> None:
        """A rank's process ended (`how`, when more is known than its code). A live pool cannot go
        on without it (its peers are stopped once the command is over: their process group lost a member)."""
        if self._live and not self._broken:
            self._broken = (f"the live ranks were {self._ended_by}" if self._ended_by
                            else f"rank {proc.ranks[0]} ended: {how or describe_exit(code, proc.pid)}")

    def stuck(self, ranks: list[int], why: str) -> None:
        """Ranks that did not return when interrupted: only a restart frees them (live pools)."""
        if self._live and ranks and not self._broken:
            self._restart_reason = f"ranks {sorted(ranks)} could not be interrupted ({why})"

    def restart_note(self) -> str:
        if self._ended_by:  # the pool is gone on purpose: nothing more to do about it
            return ""
        if self._restart_reason:
            return f"The live ranks are restarted: {self._restart_reason}; their state is lost."
        if self._live and self._broken:
            return f"{self._broken}; the live ranks take no more work until .restart()."
        return ""


def _indented(text: str) -> str:
    return ("\n" + "\n".join(f"    {line}" for line in text.splitlines())) if text else ""
