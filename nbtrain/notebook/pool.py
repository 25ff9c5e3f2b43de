"""Rank processes started once, and the commands run on them: what `launch` and `Ranks` share.

A pool is one placement's processes (forked, spawned, template-forked, torchrun, remote), the
channel to them and their output. `launch` is a pool whose ranks run one `run` command and
exit; live `Ranks` keep theirs and send command after command. Each command is watched by a
`Supervisor` into a `RunState`, shown by a display, and fails with the same `WorkerError`.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time

from ..common import protocol
from ..common.channel import Hub, OutputPump, SendInterrupted
from ..rank.loop import MARK
from ..display.rank_output import KINDS as RANK_OUTPUT, deliver
from .runmodel import RunState
from .supervisor import CONNECTION_CLOSED, NOT_SENT, Supervisor, stderr_tails
from ..common.tensor_files import LaunchFiles
from ..common.pickling import explain_pickling, ship_bytes
from ..common.source import shippable
from ..common.process_tree import descendants
from ..placements.base import PrivateStore, describe_exit, free_port
from ..rank.process import STACKS_SIGNAL

EXIT_WAIT = 5.0  # ranks that replied: how long they may take to exit on their own
STOP_GRACE = 1.0  # between SIGTERM and SIGKILL
IDLE_CHECK = 0.25  # live ranks between commands: seconds between looks at their processes and links
EXIT_CODE_WAIT = 1.0  # a rank whose link closed: how long its exit code may take to be known

log = logging.getLogger(__name__)


def _size(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size} bytes"


class PoolBroken(RuntimeError):
    """The live ranks cannot take work: one died or they were closed. `restart()` them."""


class Pool:
    def __init__(self, launcher, job, live: bool):
        self.launcher, self.job, self.live = launcher, job, live
        self.inbox: queue.Queue = queue.Queue()
        self.hub = Hub(self.inbox, **launcher.channel_options(job))
        self.pump = OutputPump(self.inbox)
        # Large returned tensors come through files this machine shares with its ranks (a remote
        # rank on another machine sends bytes instead: see clusters.base.here).
        self.files = LaunchFiles()
        self.processes: list = []
        self.store: PrivateStore | None = None  # the ranks' rendezvous, for ranks on this machine
        self.closed: set[int] = set()  # ranks whose channel closed
        self.stderr = stderr_tails()
        self.dying: set[int] = set()  # ranks that wrote faulthandler's fatal report
        self.current: dict[int, int] = {}  # rank: the seq of the command it last began
        self.marks: dict[tuple, int] = {}  # (rank, stream): the seq whose output is complete
        self.pids: dict[int, int] = {}
        self.hosts: dict[int, str | None] = {}
        self.seq = 0
        self.broken: str | None = None  # why the pool refuses work
        self.restart_reason: str | None = None  # ranks stuck beyond an interrupt: the pool must restart
        self.ended_by: str | None = None  # "restarted by .restart()": who closed the pool, for a command it ends
        self._namespace: dict = {}  # where the running command's missing names come from
        self._answers: dict[tuple, bytes | None] = {}
        self._sent: dict[int, dict[str, object]] = {}  # rank: the notebook objects it was sent, by name
        self._stopped = False
        self.state: RunState | None = None  # the first command's
        # Live ranks are watched between commands too: a rank that dies then is named at once.
        self._idle = threading.Lock()  # held by a command, and by the watcher while it looks
        self._closing = threading.Event()  # wakes the watcher to end
        self._watcher: threading.Thread | None = None
        self._held: list[tuple] = []  # messages the watcher took from the inbox, for the next command

    @property
    def ranks(self) -> list[int]:
        return self.job.ranks

    # -- life ----------------------------------------------------------------------------
    def start(self, display, timeout: float | None = None) -> RunState:
        """Start the ranks and watch their first command (`job.first`: a launch's run, or a live
        pool's start-up) to its end; the processes stay until `close`."""
        job = self.job
        self.launcher.note = display.note
        self.launcher._prepare(job)
        job.live = self.live
        job.first = protocol.Start(0, True) if self.live else protocol.Run(0, True, self.launcher._first_job(job))
        self.launcher._apply_nccl_quirks(job, display)
        if self.launcher.local:
            self.store = PrivateStore()
            job.options["store"] = self.store.path
        # Torch's variables, for libraries that read them: nothing of nbtrain's listens there.
        job.master_port = job.master_port or free_port()
        state = self.state = RunState(self._title(), job.ranks)
        display.start(state)
        self.launcher._start(job, {**self.hub.environ, **(self.files.environ if self.files else {})}, self.pump,
                             self.processes)
        self.hub.start()
        self.pump.start()
        self._watch(state, display, timeout, job.start_timeout)
        self.pids = {r: v.pid for r, v in state.ranks.items()}
        self.hosts = {r: v.host for r, v in state.ranks.items()}
        if self.live:
            self._watcher = threading.Thread(target=self._watch_idle, name="nbtrain-idle-watch", daemon=True)
            self._watcher.start()
        return state

    def _title(self) -> str:
        return f"{'live ranks' if self.live else self.job.strategy} on {self.job.plan.describe()}"

    def close(self, ok: bool = True, display=None, why: str | None = None) -> None:
        """Stop the ranks (a launch's have exited on their own when `ok`), drain their output.
        `why` ("restarted by .restart()") is what a command still running (another thread's) is told."""
        if self._stopped:
            return
        self._stopped = True
        self.ended_by = why
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        try:
            if self.live and self.any_alive():
                for rank in self.ranks:
                    self.hub.send(rank, protocol.Stop())
            if ok or self.live:
                self._wait_exits(EXIT_WAIT if ok else 1.0)
            self.stop_processes()
            self.pump.drain(timeout=1.0)
            self.drain_output(display)
        finally:
            self.hub.close()
            self.pump.close()
            self.launcher._cleanup(self.job)
            if self.store is not None:
                self.store.close()
            if self.files is not None:
                self.files.cleanup()

    def _wait_exits(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while self.any_alive() and time.monotonic() < deadline:
            time.sleep(0.002)

    def stop_processes(self, grace: float = STOP_GRACE) -> None:
        alive = [p for p in self.processes if p.poll() is None]
        # A rank ends what its code started when it exits; one stopped here may not, so its tree
        # is found first: once the rank is gone, Linux hands the tree to init (ranks on this
        # machine only).
        trees = [] if self.launcher.remote else [descendants(p.pid) for p in alive]
        for p in alive:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.01)
        for pid in (pid for tree in trees for pid in tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.processes:
            p.signal(signal.SIGKILL)  # the group too: grandchildren such as DataLoader workers
            p.join(1.0)
            p.close()

    def _queued(self):
        """The queued messages, oldest first: those the watcher held, then the inbox's."""
        held, self._held = self._held, []
        yield from held
        while True:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                return

    def shown(self, output: protocol.Output) -> bool:
        """Whether a rank's output line goes to the cell. faulthandler's report of a fatal signal
        (every thread's stack, the kernel's inherited frames, the extension modules: ~70 lines)
        is kept for the error, which shows the part that matters, and not streamed."""
        if output.stream == "stderr" and output.rank is not None:
            if output.text.startswith("Fatal Python error"):
                self.dying.add(output.rank)
            return output.rank not in self.dying
        return True

    def drain_output(self, display) -> None:
        """Hand what is still queued (the ranks' last output lines) to the display."""
        for message in self._queued():
            if isinstance(message, protocol.Output) and display is not None and not message.text.startswith(MARK):
                if self.shown(message):
                    display.output(message.rank, message.stream, message.text)
            elif isinstance(message, RANK_OUTPUT) and display is not None:
                deliver(display, message)

    def any_alive(self) -> bool:
        return any(p.poll() is None for p in self.processes)

    # -- commands ------------------------------------------------------------------------
    def command(self, kind: str, *args, ranks: list[int] | None = None, display, timeout: float | None = None,
                namespace: dict | None = None, title: str = "") -> RunState:
        """Run one command on `ranks` (all by default) and watch it to its end."""
        with self._idle:
            return self._command(kind, *args, ranks=ranks, display=display, timeout=timeout, namespace=namespace,
                                 title=title)

    def _command(self, kind: str, *args, ranks, display, timeout, namespace, title) -> RunState:
        self.check_alive()
        if self.broken:
            raise PoolBroken(f"{self.broken.rstrip('.')}. The live ranks take no more work: call .restart() (their "
                             "state is lost) or .close().")
        targets = list(self.ranks if ranks is None else ranks)
        self.seq += 1
        self._namespace, self._answers = namespace or {}, {}
        state = RunState(title or f"{kind} on live ranks {targets}", targets)
        for rank in targets:
            state.handle(protocol.Hello(rank, self.pids.get(rank), self.hosts.get(rank)))
        self.drain_idle_output(display)
        display.start(state)
        ok = False
        try:
            command = protocol.command(kind, self.seq, len(targets) == len(self.ranks), *args)
            interrupt = self._send_command(state, targets, command)
            self._watch(state, display, timeout, None, interrupt)
            ok = True
        finally:
            if self.broken:
                self.stop_processes()
            display.finish(state, ok)
        return state

    def _send_command(self, state: RunState, targets: list[int], command) -> KeyboardInterrupt | None:
        """Send `command` to every target; a Ctrl-C meanwhile, returned for the supervisor to
        handle as one that came while the ranks ran: the ranks that have the command are
        interrupted, those that do not are stopped. A message is never half sent (Hub.send)."""
        sent = []
        try:
            for rank in targets:
                if self.hub.send(rank, command):
                    sent.append(rank)
                else:  # it went away since the last look: say how
                    why = self._why_gone(rank, EXIT_CODE_WAIT)
                    state.fail(rank, why, self.last_words(rank, idle=False), crashed=True)
                    self.broken = self.broken or why
        except SendInterrupted as interrupt:
            if interrupt.whole:
                sent.append(interrupt.rank)
            else:  # the rank sees its connection close, and ends: only fresh ranks can go on
                why = (f"the link to rank {interrupt.rank} was cut in the middle of a {_size(interrupt.size)} message "
                       f"({interrupt.why})")
                if self.live and not self.broken:
                    self.restart_reason = why
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

    def drain_idle_output(self, display) -> None:
        """Output a live rank wrote between commands (a thread of its own, say) goes to the next cell."""
        pending = []
        for message in self._queued():
            if isinstance(message, protocol.Output):
                if not message.text.startswith(MARK) and self.shown(message):
                    display.output(message.rank, message.stream, message.text)
            elif isinstance(message, RANK_OUTPUT):
                deliver(display, message)
            elif isinstance(message, protocol.Closed):
                self.closed.add(message.rank)
            else:
                pending.append(message)
        for message in pending:  # anything else belongs to the command about to start
            self.inbox.put(message)

    # -- between commands ----------------------------------------------------------------
    def _watch_idle(self) -> None:
        while not self._closing.wait(IDLE_CHECK) and not self.broken:
            if not self._idle.acquire(blocking=False):
                continue  # a command runs: its supervisor watches the ranks
            try:
                if not self._closing.is_set():
                    self.check_alive(warn=True)
            except Exception:  # closed under it: the next look, or none, says it
                log.debug("idle watch", exc_info=True)
            finally:
                self._idle.release()

    def check_alive(self, warn: bool = False) -> None:
        """Between commands: a live rank that ended (killed, crashed, its job cancelled) breaks the
        pool, named with its exit code or signal; with `warn`, said at once (logging)."""
        if not self.live or self.broken or self._stopped:
            return
        for rank in self.ranks:
            proc = self._process_of(rank)
            # A remote rank's process is the engine's, slow to ask: its closed connection says it ended.
            ended = not self.launcher.remote and proc is not None and proc.poll() is not None
            if ended or not self.hub.connected(rank):
                self.broken = self._why_gone(rank, EXIT_CODE_WAIT)
                if warn:
                    log.warning("nbtrain: %s; the live ranks take no more work until .restart().%s",
                                self.broken.rstrip("."), _indented(self.last_words(rank)))
                return

    def _process_of(self, rank: int):
        return next((p for p in self.processes if rank in p.ranks), None)

    def _why_gone(self, rank: int, wait: float) -> str:
        """How `rank` ended: its exit code or signal, once known (waiting up to `wait` s)."""
        proc = self._process_of(rank)
        deadline = time.monotonic() + wait
        while proc is not None:
            code = proc.poll()
            if code is not None:
                summary, _ = proc.exit_reason(rank, code, self.pids.get(rank) or proc.pid)
                return f"rank {rank} ended: {summary}"
            lost = proc.lost_reason(rank)  # an engine's word on a rank whose process is not ours
            if lost or time.monotonic() > deadline:
                return f"rank {rank} ended: {lost or CONNECTION_CLOSED}"
            time.sleep(0.05)
        return f"rank {rank} ended: {CONNECTION_CLOSED}"

    def last_words(self, rank: int, idle: bool = True) -> str:
        """faulthandler's report of the fatal signal that ended a rank, if it wrote one; `idle`:
        between commands, when what is queued may be looked through."""
        if idle:
            self.pump.drain(timeout=0.2)  # its pipes' last lines
            self._hold_inbox()
        lines = list(self.stderr[rank])
        starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
        return "\n".join(lines[starts[-1]:]).strip() if starts else ""

    def _hold_inbox(self) -> None:
        """Between commands: take what is queued, keeping the ranks' stderr lines for `last_words`;
        the messages themselves go to the next command (`drain_idle_output`)."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, protocol.Output) and message.stream == "stderr" and message.rank is not None \
                    and not message.text.startswith(MARK):
                self.stderr[message.rank].append(message.text)
            self._held.append(message)

    # -- what the supervisor asks of the pool ------------------------------------------------
    def interrupt(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.hub.send(rank, protocol.Interrupt(self.seq))

    def ask_stacks(self, pids: dict[int, int | None]) -> None:
        for rank, pid in pids.items():
            if self.launcher.remote or not pid:
                self.hub.send(rank, protocol.Stacks())
                continue
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                pass

    def lost(self, proc, code: int, how: str | None = None) -> None:
        """A rank's process ended (`how`, when more is known than its code). A live pool cannot go
        on without it (its peers are stopped once the command is over: their process group lost a member)."""
        if self.live and not self.broken:
            self.broken = (f"the live ranks were {self.ended_by}" if self.ended_by
                           else f"rank {proc.ranks[0]} ended: {how or describe_exit(code, proc.pid)}")

    def stuck(self, ranks: list[int], why: str) -> None:
        """Ranks that did not return when interrupted: only a restart frees them (live pools)."""
        if self.live and ranks and not self.broken:
            self.restart_reason = f"ranks {sorted(ranks)} could not be interrupted ({why})"

    def restart_note(self) -> str:
        if self.ended_by:  # the pool is gone on purpose: nothing more to do about it
            return ""
        if self.restart_reason:
            return f"The live ranks are restarted: {self.restart_reason}; their state is lost."
        if self.live and self.broken:
            return f"{self.broken}; the live ranks take no more work until .restart()."
        return ""

    def answer_need(self, rank: int, seq: int, names: list[str], display) -> None:
        """A rank lacks names its code reads, or asks again for ones it took from the notebook:
        send those the notebook has, leaving out what this rank already has as it is here."""
        sent = self._sent.setdefault(rank, {})
        fresh = [n for n in names if not (n in sent and self._namespace.get(n, sent) is sent[n])]
        key = tuple(fresh)
        if key not in self._answers:
            self._answers[key] = self._pack_names(fresh, display)
        sent.update((n, self._namespace[n]) for n in fresh if n in self._namespace)
        self.hub.send(rank, protocol.Names(seq, self._answers[key]))

    def _pack_names(self, names: list[str], display) -> bytes | None:
        found = {n: self._namespace[n] for n in names if n in self._namespace and shippable(n, ())}
        if not found:
            return None
        try:
            return ship_bytes(found)
        except Exception:
            bad = {n for n, v in found.items() if explain_pickling(v, "dill", n)}
            for name in sorted(bad):
                lines = [f"  {f.path}: {f.type} — {f.reason}" for f in explain_pickling(found[name], "dill", name)]
                display.note(f"{name!r} cannot be sent to the ranks; define it there instead "
                             f"(ranks.exec or %%ranks):\n" + "\n".join(lines))
            rest = {n: v for n, v in found.items() if n not in bad}
            return ship_bytes(rest) if rest else None

    def answer_prompt(self, rank: int, prompt: str) -> None:
        """A rank's debugger waits for a line: ask the notebook's user."""
        try:
            line = input(prompt)
        except (EOFError, RuntimeError, NotImplementedError) as exc:  # no stdin here (a script, nbconvert)
            print(f"nbtrain: no input available for rank {rank}'s debugger ({type(exc).__name__}); quitting it.")
            line = "q"
        self.hub.send(rank, protocol.Stdin(line))


def _indented(text: str) -> str:
    return ("\n" + "\n".join(f"    {line}" for line in text.splitlines())) if text else ""
