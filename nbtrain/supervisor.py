"""The notebook side of a running launch: watch every rank until all finish or one fails.

Runs on the kernel's main thread, so Ctrl-C reaches it and output lands in the running cell.
On a failure, a timeout or an interrupt every rank is stopped (SIGTERM to its process group,
SIGKILL after a short grace) before the error is raised: nothing is left running.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections import defaultdict, deque

from .errors import WorkerError
from .launchers.base import RankProcess
from .runstate import RunState
from .transfer import unpack_exception
from .worker import STACKS_SIGNAL

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between checks of the processes
EXIT_POLL = 0.002  # while ranks that reported are exiting: the launch returns as soon as they are gone
SETTLING = ("result", "value", "error", "closed")
EXIT_DRAIN = 1.0  # after a process exits, how long its last messages may take to arrive
PEER_ERRORS = 0.3  # after a failure, how long to listen for the others' before naming the cause
STOP_GRACE = 1.0  # between SIGTERM and SIGKILL
STACK_WAIT = 1.0  # for faulthandler's dumps after asking for them
STDERR_TAIL = 300  # lines of a rank's stderr kept to explain a crash


OWN_THREADS = ("in _send_loop", "in _watch_parent")  # nbtrain's helper threads in a rank
RANK_ENTRY = "in run_rank"  # below it: the launcher, and in a fork the kernel's own frames


def tidy_stacks(dump: str) -> str:
    """faulthandler's dump without nbtrain's own threads and frames, so the user's code leads."""
    blocks = []
    for block in dump.split("\n\n"):
        if any(marker in block for marker in OWN_THREADS):
            continue
        lines = block.splitlines()
        entry = next((i for i, line in enumerate(lines) if RANK_ENTRY in line), None)
        blocks.append("\n".join(lines if entry is None else lines[:entry]))
    return "\n\n".join(b for b in blocks if b.strip() and not b.startswith("Extension modules"))


class Supervisor:
    def __init__(self, state: RunState, inbox: queue.Queue, processes: list[RankProcess], display,
                 timeout: float | None, start_timeout: float | None):
        self.state = state
        self.inbox = inbox
        self.processes = processes
        self.display = display
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._closed: set[int] = set()
        self._stderr: dict[int, deque] = defaultdict(lambda: deque(maxlen=STDERR_TAIL))
        self._capturing: dict[int, list[str]] | None = None  # stacks being collected

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Return when every rank finished; raise WorkerError or KeyboardInterrupt otherwise."""
        try:
            while self.state.unfinished() and not self.state.failures:
                self._pump(TICK, until_settled=True)
                self._check_processes()
                self._check_deadlines()
                self.display.update(self.state)
            if self.state.failures:
                self._pump(PEER_ERRORS)
                self._check_processes()
                raise self._worker_error()
            self._wait_exits()
        except KeyboardInterrupt:
            self.stop(grace=0.2)
            raise
        finally:
            self.stop()
            self.state.ended = time.monotonic()

    def _pump(self, timeout: float, until_settled: bool = False) -> None:
        """Handle messages for up to `timeout` s; with `until_settled`, return as soon as one
        may have ended the run (a result, an error, a closed channel), so no tick is wasted."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self._handle(message)
            if until_settled and message[0] in SETTLING:
                return
            if self.inbox.empty() and time.monotonic() >= deadline:
                return

    def _handle(self, message: tuple) -> None:
        kind, rank = message[0], message[1]
        if kind == "closed":
            self._closed.add(rank)
        elif kind == "output":
            _, rank, stream, text = message
            if stream == "stderr" and rank is not None:
                self._stderr[rank].append(text)
            if self._capturing is not None and rank in self._capturing and stream == "stderr":
                self._capturing[rank].append(text)
            else:
                self.display.output(rank, stream, text)
        else:
            self.state.handle(message)

    # -- failures ------------------------------------------------------------------------
    def _check_processes(self) -> None:
        now = time.monotonic()
        for proc in self.processes:
            code = proc.poll()
            if code is None:
                continue
            proc.exited_at = proc.exited_at or now
            missing = [r for r in proc.ranks if r in self.state.unfinished()]
            drained = all(r in self._closed for r in missing)
            if not missing or (not drained and now - proc.exited_at < EXIT_DRAIN):
                continue  # its own result or error report may still be on the way
            for r in missing:
                summary, crashed = proc.exit_reason(r, code, self.state.ranks[r].pid or proc.pid)
                self.state.fail(r, summary, self._last_words(r), crashed=crashed)

    def _last_words(self, rank: int) -> str:
        # faulthandler's report of a fatal signal, if the rank wrote one; else its last stderr lines.
        lines = list(self._stderr[rank])
        starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
        return tidy_stacks("\n".join(lines[starts[-1]:] if starts else lines[-40:]))

    def _check_deadlines(self) -> None:
        elapsed = self.state.elapsed
        if self.timeout is not None and elapsed > self.timeout:
            self._fail_with_stacks(f"timed out after {self.timeout:g} s")
        elif self.start_timeout is not None and elapsed > self.start_timeout:
            silent = [r for r, v in self.state.ranks.items() if v.status == "starting"]
            if silent:
                self._fail_with_stacks(f"did not start within {self.start_timeout:g} s", only=silent)

    def _fail_with_stacks(self, why: str, only: list[int] | None = None) -> None:
        running = only or self.state.unfinished()
        stacks = self.collect_stacks(running)
        done = [r for r, v in self.state.ranks.items() if v.status == "finished"]
        summary = f"{why}; still running: ranks {running}" + (f"; finished: ranks {done}" if done else "")
        text = "\n\n".join(f"--- rank {r} stack ---\n" + (stacks.get(r) or "(no stack: the rank did not answer)")
                           for r in running)
        self.state.fail(running[0], summary, text)
        for r in running[1:]:
            self.state.fail(r, why)

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every listed rank's Python stacks (faulthandler), before anything is stopped."""
        self._capturing = {r: [] for r in ranks}
        pids = {r: self.state.ranks[r].pid for r in ranks}
        for pid in filter(None, pids.values()):
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                pass
        self._pump(STACK_WAIT)
        captured, self._capturing = self._capturing, None
        return {r: tidy_stacks("\n".join(lines)) for r, lines in captured.items()}

    def _worker_error(self) -> WorkerError:
        cause = self.state.root_cause()
        others = tuple(f"rank {f.rank}: {f.summary.splitlines()[0]}" for f in self.state.failures if f is not cause)
        return WorkerError.from_failure(cause.rank, cause.summary, cause.traceback, others,
                                        original=unpack_exception(cause.original))

    # -- stopping ------------------------------------------------------------------------
    def _wait_exits(self) -> None:
        # Every rank reported; give the processes a moment to exit on their own.
        deadline = time.monotonic() + 5.0
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            self._pump(EXIT_POLL)

    def stop(self, grace: float = STOP_GRACE) -> None:
        alive = [p for p in self.processes if p.poll() is None]
        for p in alive:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in self.processes:
            p.signal(signal.SIGKILL)  # the group too: grandchildren such as DataLoader workers
            p.join(1.0)
            p.close()
        self.processes = []

    def flush(self) -> None:
        """Hand what is still queued (the ranks' last output lines) to the display."""
        while True:
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return
