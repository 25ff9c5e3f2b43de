"""JupyterLab's debugger on the ranks: the kernel's own Debug Adapter Protocol handler, extended.

ipykernel (>= 6) takes DAP requests on its control channel (`debug_request`) and answers them
through debugpy, in the kernel. `install` wraps that handler (`kernel.debugger.process_request`):
requests about a rank go to the rank over nbtrain's authenticated channel, where a small bdb
tracer answers (`rank/debugger.py`); all others go to ipykernel's as before, so the kernel's own
breakpoints keep working. The ranks are threads beside the kernel's (`rank 0`, `rank 1`, ...):

- `setBreakpoints` sets the kernel's, then every connected rank's (a rank started later starts
  with them: forked, the kernel's copy of the rank's debugger holds them; otherwise its
  environment does, `breakpoints_environ`);
- `threads` lists the kernel's threads, then each rank of each pool (live ranks, a launch);
- `stackTrace`, `continue`/`next`/`stepIn`/`stepOut` with a rank's thread id, `scopes` and
  `evaluate` with a rank's frame id, `variables` with a rank's reference go to that rank;
  stepping acts on every paused rank of its pool unless `singleThread` is asked;
- a rank's `stopped` and `continued` events reach the client as the kernel's own do (IOPub).

A rank's frame ids and variable references are its own small numbers; here they are given ids
of the kernel's (`REF_BASE` up, far above debugpy's) so the client never sees the same twice.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import queue
import sys
import threading
import weakref

from ...common import protocol
from ...rank.debugger import BREAKPOINTS_VAR
from ...rank.debugger import DEBUGGER as IN_KERNEL

log = logging.getLogger(__name__)

THREAD_BASE = 1 << 30  # a rank's thread id: far above debugpy's, which counts from 1
REF_BASE = 1 << 40  # frame ids and variable references of ranks, as the client sees them
ANSWER_SECONDS = 30.0  # a rank that does not answer a request by then is said to be busy
STEPS = ("continue", "next", "stepIn", "stepOut")
UNREACHABLE = ("nbtrain: the breakpoints in this %%nbtrain cell do not stop its ranks (its body runs there as code "
               "of its own): to stop there, put the code in a function and nbtrain.launch it, or run it with %%ranks.")
BY_THREAD = STEPS + ("stackTrace", "pause")
BY_FRAME = ("scopes", "evaluate")

_ports: weakref.WeakSet[DebugPort] = weakref.WeakSet()
_active: list[RanksDebugger] = []  # the kernel's, once installed


def _live_ports() -> list[DebugPort]:
    """The pools' ports, oldest first (read from the control thread while the main one may add one)."""
    while True:
        try:
            return sorted(_ports, key=lambda port: port.serial)
        except RuntimeError:  # "changed size during iteration": a pool started meanwhile
            continue


class DebugPort(queue.Queue):
    """A pool's inbox that hands the ranks' debugger messages to the kernel's debugger, and the
    pool's way to send it requests: `ranks()` (those connected) and `send(rank, message)`."""

    _serial = itertools.count()

    def __init__(self, ranks, send):
        super().__init__()
        self.ranks, self.send = ranks, send
        self.serial = next(self._serial)
        self.opened = False  # a rank's frames were opened in the panel (a kept stalled launch stays past its cell)
        _ports.add(self)

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, protocol.DEBUGGER):
            if _active:
                _active[0].receive(self, item)
            return
        if isinstance(item, (protocol.Returned, protocol.Raised)) and _active:
            _active[0].ended(self, item.rank)
        super().put(item, block, timeout)


class RanksDebugger:
    def __init__(self, kernel):
        self.kernel, self.inner = kernel, kernel.debugger.process_request
        self.breakpoints: dict[str, dict] = {}  # path: the setBreakpoints arguments, as the ranks got them
        self._told: weakref.WeakKeyDictionary[DebugPort, dict[int, int]] = weakref.WeakKeyDictionary()
        self._version = 0
        self._seq = itertools.count(1)
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._threads: dict[tuple[int, int], int] = {}  # (port serial, rank): thread id
        self._thread_of: dict[int, tuple[DebugPort, int]] = {}
        self._refs: dict[int, tuple[DebugPort, int, int]] = {}  # ours: (port, rank, the rank's)
        self._ref_ids = itertools.count(REF_BASE)
        self._stopped: set[int] = set()
        self._last_stopped = 0  # the rank thread that stopped last
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.raw_cell: str | None = None  # the cell running now, as the client sent it (dumpCell's name is its hash)

    def note_cell(self, info) -> None:
        self.raw_cell = info.raw_cell
        if self._unreachable(info.raw_cell):
            print(UNREACHABLE)

    def _unreachable(self, raw: str | None) -> bool:
        """A `%%nbtrain` cell with breakpoints set in its gutter: its body runs on the ranks as code
        of its own (`rank/cell.py`), never on the lines the panel knows."""
        if not raw or not raw.lstrip().startswith("%%nbtrain") or not self.breakpoints:
            return False
        from ipykernel.compiler import get_file_name

        return bool(self.breakpoints.get(get_file_name(raw), {}).get("breakpoints"))

    # -- the control thread: every debug_request -------------------------------------------------
    async def process_request(self, message: dict) -> dict:
        self._loop = asyncio.get_running_loop()
        command, args = message.get("command"), message.get("arguments") or {}
        target = self._target(command, args)
        if target is None and command in STEPS and self._last_stopped in self._stopped \
                and args.get("threadId") not in getattr(self.kernel.debugger, "stopped_threads", ()):
            # JupyterLab's panel steps thread 1 whichever thread stopped (its service tracks no
            # threads): with the kernel's own running, the paused ranks are what it means.
            target = (*self._thread_of[self._last_stopped], None)
        if target is not None:
            return await self._for_rank(message, *target)
        if command == "initialize":
            _no_subprocess_patching()
        reply = await self.inner(message)
        if command == "initialize":
            _unfollow_children()
        if command == "threads" and reply.get("success"):
            reply["body"]["threads"] = reply["body"].get("threads", []) + self._rank_threads()
        elif command == "setBreakpoints":
            await self._set_breakpoints(args)
        elif command == "debugInfo" and reply.get("body"):
            reply["body"]["stoppedThreads"] = list(reply["body"].get("stoppedThreads", [])) + sorted(self._stopped)
        elif command == "disconnect":
            await self._disconnect()
        return reply

    def _target(self, command, args: dict):
        """(port, rank, the rank's own reference) of a request about a rank; None for the kernel's."""
        if command in BY_THREAD:
            found = self._thread_of.get(args.get("threadId"))  # type: ignore[arg-type]
            return (*found, None) if found else None
        key = "variablesReference" if command == "variables" else "frameId" if command in BY_FRAME else None
        return self._refs.get(args.get(key)) if key else None  # type: ignore[arg-type]

    async def _for_rank(self, message: dict, port: DebugPort, rank: int, local: int | None) -> dict:
        command, args = message["command"], dict(message.get("arguments") or {})
        if command == "variables":
            args["variablesReference"] = local
        elif command in BY_FRAME:
            args["frameId"] = local
        if command in STEPS and not args.get("singleThread"):  # every paused rank of this pool goes on
            others = [r for (p, r) in self._paused(port) if r != rank]
            await asyncio.gather(*(self._ask(port, r, command, args) for r in others))
        success, body, error = await self._ask(port, rank, command, args)
        if success:
            self._translate(command, body, port, rank)
        return {"type": "response", "request_seq": message.get("seq"), "success": success, "command": command,
                "body": body, **({"message": error} if error else {})}

    def _translate(self, command: str, body: dict, port: DebugPort, rank: int) -> None:
        """The rank's frame ids and references made the client's."""
        items = {"stackTrace": body.get("stackFrames", ()), "scopes": body.get("scopes", ()),
                 "variables": body.get("variables", ()), "evaluate": [body]}.get(command, ())
        key = "id" if command == "stackTrace" else "variablesReference"
        for item in items:
            if item.get(key):
                ours = next(self._ref_ids)
                self._refs[ours] = (port, rank, item[key])
                item[key] = ours

    async def _ask(self, port: DebugPort, rank: int, command: str, args: dict) -> tuple[bool, dict, str]:
        seq = next(self._seq)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[(port.serial, rank, seq)] = future
        try:
            if not port.send(rank, protocol.DebugRequest(seq, command, args)):
                return False, {}, f"rank {rank} is gone"
            reply = await asyncio.wait_for(asyncio.wrap_future(future), ANSWER_SECONDS)
            return reply.success, reply.body, reply.message
        except TimeoutError:
            return False, {}, f"rank {rank} did not answer {command!r} within {ANSWER_SECONDS:g} s"
        finally:
            self._pending.pop((port.serial, rank, seq), None)

    # -- breakpoints ---------------------------------------------------------------------------------
    async def _set_breakpoints(self, args: dict) -> None:
        path = args.get("source", {}).get("path")
        if not path:
            return
        wanted = [{"line": b["line"], "condition": b.get("condition")} for b in args.get("breakpoints", [])]
        try:
            with open(path, encoding="utf-8") as file:  # the cell as dumpCell wrote it
                content: str | None = file.read()
        except OSError:
            content = None
        self.breakpoints[path] = {"source": {"path": path}, "breakpoints": wanted, "content": content}
        self._version += 1
        IN_KERNEL.set_breakpoints(path, wanted, content)  # what a rank forked from now on starts with
        await asyncio.gather(*(self._tell(port, rank, path) for port in _live_ports() for rank in port.ranks()))

    async def _tell(self, port: DebugPort, rank: int, path: str) -> None:
        success, _, error = await self._ask(port, rank, "setBreakpoints", self.breakpoints[path])
        self._told.setdefault(port, {})[rank] = self._version
        if not success:
            log.warning("nbtrain: rank %d's breakpoints in %s were not set: %s", rank, path, error)

    def sync(self) -> None:
        """Every connected rank has the breakpoints set so far (ranks started since: spawned,
        template-forked). From the kernel's main thread, before a cell runs on the ranks."""
        for port in _live_ports():
            told = self._told.setdefault(port, {})
            for rank in port.ranks():
                if told.get(rank) != self._version:
                    told[rank] = self._version
                    for args in list(self.breakpoints.values()):
                        port.send(rank, protocol.DebugRequest(next(self._seq), "setBreakpoints", args))

    async def _disconnect(self) -> None:
        self.breakpoints.clear()
        self._version += 1
        IN_KERNEL.clear_all_breaks()
        await asyncio.gather(*(self._ask(port, rank, "disconnect", {}) for port in _live_ports()
                               for rank in port.ranks()))
        self._stopped.clear()

    # -- threads -------------------------------------------------------------------------------------
    def _thread(self, port: DebugPort, rank: int) -> int:
        with self._lock:
            key = (port.serial, rank)
            if key not in self._threads:
                self._threads[key] = THREAD_BASE + len(self._threads)
                self._thread_of[self._threads[key]] = (port, rank)
            return self._threads[key]

    def _rank_threads(self) -> list[dict]:
        return [{"id": self._thread(port, rank), "name": f"rank {rank}"} for port in _live_ports()
                for rank in port.ranks()]

    def _paused(self, port: DebugPort) -> list[tuple[DebugPort, int]]:
        return [self._thread_of[t] for t in sorted(self._stopped) if self._thread_of[t][0] is port]

    # -- a hub's reading thread: what the ranks say ---------------------------------------------------
    def receive(self, port: DebugPort, message) -> None:
        if isinstance(message, protocol.DebugReply):
            future = self._pending.get((port.serial, message.rank, message.seq))
            if future is not None and not future.done():
                future.set_result(message)
            return
        thread = self._thread(port, message.rank)
        body = dict(message.body, threadId=thread)
        if message.event == "stopped":
            self._stopped.add(thread)
            self._last_stopped = thread
            body.update(allThreadsStopped=False, description=f"rank {message.rank}")
        elif message.event == "continued":
            self._stopped.discard(thread)
            body.update(allThreadsContinued=False)
        self._publish({"type": "event", "seq": next(self._seq), "event": message.event, "body": body})

    def ended(self, port: DebugPort, rank: int) -> None:
        """`rank` replied to its command: it is not paused, whatever it said before (a second
        interrupt may have cut its `continued` short)."""
        thread = self._threads.get((port.serial, rank))
        if thread in self._stopped:
            self.receive(port, protocol.DebugEvent(rank, "continued", {}))

    def _publish(self, event: dict) -> None:
        """On IOPub, as ipykernel sends debugpy's events, from the control thread's loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no client ever spoke to the debugger: nobody listens
        loop.call_soon_threadsafe(self.kernel._publish_debug_event, event)


def _no_subprocess_patching() -> None:
    """debugpy, started by ipykernel at the first `initialize`, by default patches `os.fork` so a
    child connects to it as a debuggee of its own: a rank would hang in that connection. The
    ranks have their own debugger; the patch is asked off before debugpy starts."""
    import debugpy

    try:
        debugpy.configure(subProcess=False)
    except RuntimeError:  # already listening (configure comes too late): it stays as it is
        log.debug("debugpy started before nbtrain's debugger", exc_info=True)


def _unfollow_children() -> None:
    """What debugpy patched to follow child processes, put back (it keeps each original as
    `original_<name>` beside it): debugpy started with that on before `%load_ext nbtrain` (the
    panel was switched on first), and a rank, forked or spawned, would dial it and wait."""
    import _posixsubprocess
    import os

    for module in (os, _posixsubprocess):
        for name, original in list(vars(module).items()):
            if name.startswith("original_") and hasattr(module, name[len("original_"):]):
                setattr(module, name[len("original_"):], original)


def install(shell) -> RanksDebugger | None:
    """Extend the debugger of `shell`'s kernel (ipykernel's) to the ranks; once per kernel. None without one."""
    kernel = getattr(shell, "kernel", None)
    if _active:
        return _active[0]
    debugger = getattr(kernel, "debugger", None) if kernel is not None else None
    if debugger is None or not hasattr(debugger, "process_request"):
        return None
    if "debugpy" in sys.modules:
        _unfollow_children()
    ours = RanksDebugger(kernel)
    shell.events.register("pre_run_cell", ours.note_cell)
    debugger.process_request = ours.process_request  # the handler ipykernel's do_debug_request awaits
    _active.append(ours)
    return ours


def started() -> bool:
    """The client's debugger is on (JupyterLab's toggle): cells are compiled under dumpCell's names."""
    return bool(_active) and bool(getattr(_active[0].kernel.debugger, "is_started", False))


def post_mortem(rank: int, only: DebugPort | None = None) -> bool:
    """With the client's debugger on: open live rank `rank`'s last failure in the panel (its
    frames, its variables; continue closes it), or where it waits when it is stuck (a stalled
    launch kept). False when the debugger is off or no pool (`only`'s, or any live one) has that rank connected."""
    if not started():
        return False
    for port in [only] if only is not None else reversed(_live_ports()):
        if rank in port.ranks():
            port.opened = True
            return bool(port.send(rank, protocol.DebugRequest(next(_active[0]._seq), "postMortem", {})))
    return False


def sync() -> None:
    if _active:
        _active[0].sync()


def breakpoints_environ() -> dict[str, str]:
    """The breakpoints set in the panel, for the environment of ranks about to start (empty when
    none is set: a rank then pays nothing). A rank forked from the kernel inherits them; one
    started by the warm template, spawn or a cluster reads them here before it runs any code, so
    a breakpoint stops its first command too. Each file's text goes along (dumpCell wrote it on
    this machine only)."""
    files = list(_active[0].breakpoints.values()) if _active else []  # a copy: the control thread sets them
    if not any(args["breakpoints"] for args in files):
        return {}
    return {BREAKPOINTS_VAR: json.dumps(files)}


def cell_for_ranks(shell, cell: str) -> tuple[str, str] | None:
    """With the client's debugger on, a ``%%ranks`` cell's body as the ranks run it: at its lines
    in the whole cell, under the name dumpCell gave the whole cell, so a breakpoint set in the
    gutter is on the line the ranks run. None when the debugger is off (or the cell is unknown)."""
    raw = _active[0].raw_cell if started() else None
    if raw is None:
        return None
    lines = raw.splitlines()
    magic = next((i for i, line in enumerate(lines) if line.lstrip().startswith("%%ranks")), None)
    if magic is None:  # run by run_cell_magic, say: not a cell of its own
        return None
    source = "\n" * (magic + 1) + cell
    history = getattr(shell.history_manager, "input_hist_raw", None)
    number = len(history) - 1 if history else shell.execution_count  # as `%%ranks` numbers its cells
    return source, shell.compile.cache(source, number, raw_code=raw)
