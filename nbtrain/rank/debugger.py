"""A rank's side of the notebook's visual debugger (JupyterLab's panel): breakpoints, stepping and
inspection of the rank's main thread, asked for by the kernel (`notebook/run/debugger.py`) as Debug
Adapter Protocol requests over the run's authenticated channel. Nothing listens on a port.

Tracing is `bdb`'s, on the main thread only, and only while user code runs *and* a breakpoint is
set (`arm`, `disarm` around each command's user code): with none set, a command costs one check.
Requests come on the link's receiving thread: breakpoints are set there; what needs the stopped
frames (the stack, scopes, variables, evaluate, stepping) is handed to the main thread, which
waits in `_pause` until it is told to go on. Frame ids and variable references are numbers of
this pause, valid until the rank goes on.
"""
from __future__ import annotations

import bdb
import json
import linecache
import os
import queue
import reprlib
import sys
import threading
import traceback

from ..common import protocol
from ..common.tracebacks import package_path

STEPS = ("continue", "next", "stepIn", "stepOut")
BREAKPOINTS_VAR = "NBTRAIN_BREAKPOINTS"  # the panel's breakpoints, for a rank not forked from the kernel
MAX_CHILDREN = 300  # items of a list or dict shown under it
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 200
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 10
_HIDDEN = ("__builtins__", "<nbtrain last value>")


class RankDebugger(bdb.Bdb):
    def __init__(self):
        # Never stop in nbtrain's own frames (the loop around the user's code) nor inside torch when stepping.
        super().__init__(skip=["nbtrain.*", "torch.*"])
        self.link = None
        self.requests: queue.Queue = queue.Queue()
        self.armed = False
        self._paused = False
        self._lock = threading.Lock()
        self._stepping = False
        self._frames: list = []  # the paused stack, innermost first: frame id - 1 is its index
        self._refs: dict[int, object] = {}  # variablesReference -> what it expands
        self._last_failure = lambda: None  # the traceback of the rank's last failed command
        self._busy = lambda: False  # the main thread runs (or is stuck in) the user's code
        self._wake = lambda: None  # has the main thread call `arm_running` (its signal handler)
        self._post_mortem = False  # its frames are open in the panel (answered on the receiving thread)

    def attach(self, link, last_failure=lambda: None, busy=lambda: False, wake=lambda: None) -> None:
        """This process is a rank that `link` serves. A rank forked from a kernel that debugpy
        traces inherits its tracer, whose threads and socket stayed in the kernel: a breakpoint
        would wait for them forever. Off, here: the rank's own debugger is this one."""
        self.link, self._last_failure, self._busy, self._wake = link, last_failure, busy, wake
        for args in json.loads(os.environ.pop(BREAKPOINTS_VAR, "[]")):  # before the rank's first command runs
            self.set_breakpoints(args["source"]["path"], args["breakpoints"], args.get("content"))
        tracing = sys.modules.get("pydevd_tracing")
        if tracing is not None:
            tracing.restore_sys_set_trace_func()  # its sys.settrace warns at every call, in every rank
        if "pydevd" in sys.modules:
            sys.settrace(None)
            threading.settrace(None)

    # -- the main thread: around the user's code -------------------------------------------
    def arm(self) -> None:
        """Trace the user's code about to run, if a breakpoint is set (else nothing: no cost)."""
        if not self.breaks or self.link is None:
            return
        self.reset()
        # `bdb` stops everywhere while its stop frame is None: a frame that never runs again
        # stands in for it (and for the bottom frame), so only breakpoints stop the code.
        self.botframe = sys._getframe()
        self.set_continue()
        self._stepping = False
        self.armed = True
        sys.settrace(self.trace_dispatch)

    def arm_running(self, frame) -> None:
        """Breakpoints set while the user's code already runs untraced: from the main thread's
        signal handler (`frame`: where it was), trace on from here, in the frames of the user's
        code on the stack and in those they call."""
        if self.armed or not self.breaks or self.link is None or not self._busy():
            return
        self.reset()
        self.botframe = sys._getframe()  # the handler's: never runs again (see `arm`)
        self.set_continue()
        self._stepping = False
        self.armed = True
        for running in _user_stack(frame):
            running.f_trace = self.trace_dispatch
        sys.settrace(self.trace_dispatch)

    def disarm(self) -> None:
        if self.armed:
            sys.settrace(None)
            self.armed = False

    def user_line(self, frame) -> None:
        self._pause(frame, "step" if self._stepping else "breakpoint")

    def _pause(self, frame, reason: str) -> None:
        self._frames, self._refs, self._post_mortem = _user_stack(frame), {}, False
        with self._lock:
            self._paused = True
        self._emit(protocol.DebugEvent(self.link.rank, "stopped", {"reason": reason}))
        try:
            while True:
                request = self.requests.get()
                if self._answer_paused(request):
                    break
        finally:
            self._emit(protocol.DebugEvent(self.link.rank, "continued", {}))
            with self._lock:
                self._paused = False
                while not self.requests.empty():  # asked while it went on: too late
                    self._refuse(self.requests.get_nowait())
            self._frames, self._refs = [], {}

    def _answer_paused(self, request) -> bool:
        """Answer one request of a paused rank; True if the rank goes on."""
        command, args = request.command, request.arguments
        if command in STEPS or command == "disconnect":
            frame = self._frames[0] if self._frames else None
            self._stepping = command in ("next", "stepIn", "stepOut")
            if command == "next" and frame is not None:
                self.set_next(frame)
            elif command == "stepIn":
                self.set_step()
            elif command == "stepOut" and frame is not None:
                self.set_return(frame)
            else:
                self.set_continue()
            self._reply(request, True, {"allThreadsContinued": False} if command == "continue" else {})
            return True
        if command == "pause":  # paused already
            self._reply(request, True, {})
            return False
        handler = getattr(self, f"_{command}", None)
        if handler is None:
            self._reply(request, False, {}, f"{command!r} is not something a rank's debugger answers")
            return False
        try:
            self._reply(request, True, handler(args))
        except Exception as exc:  # the user's expression, a frame gone: the panel shows the message
            self._reply(request, False, {}, f"{type(exc).__name__}: {exc}")
        return False

    # -- what a paused rank answers (main thread) -----------------------------------------------
    def _stackTrace(self, args: dict) -> dict:
        start = int(args.get("startFrame") or 0)
        count = int(args.get("levels") or 0) or len(self._frames)
        frames = []
        for index, frame in enumerate(self._frames[start:start + count], start):
            code = frame.f_code
            source = {"path": code.co_filename, "name": code.co_filename.rsplit("/", 1)[-1]}
            frames.append({"id": index + 1, "name": code.co_name, "line": frame.f_lineno, "column": 1,
                           "source": source})
        return {"stackFrames": frames, "totalFrames": len(self._frames)}

    def _scopes(self, args: dict) -> dict:
        frame = self._frame(args)
        return {"scopes": [
            {"name": "Locals", "variablesReference": self._ref(("scope", frame.f_locals)), "expensive": False},
            {"name": "Globals", "variablesReference": self._ref(("scope", frame.f_globals)), "expensive": False},
        ]}

    def _variables(self, args: dict) -> dict:
        target = self._refs[int(args["variablesReference"])]
        if isinstance(target, tuple) and target[0] == "scope":
            items = [(k, v) for k, v in target[1].items() if not (k.startswith("__") or k in _HIDDEN)]
        else:
            items = _children(target)
        return {"variables": [self._variable(str(name), value) for name, value in items[:MAX_CHILDREN]]}

    def _evaluate(self, args: dict) -> dict:
        frame = self._frame(args)
        expression = args["expression"]
        try:
            code = compile(expression, "<debugger evaluate>", "eval")
        except SyntaxError:  # a statement: run it, as the debug console does
            exec(compile(expression, "<debugger evaluate>", "exec"), frame.f_globals, frame.f_locals)
            return {"result": "", "variablesReference": 0}
        value = eval(code, frame.f_globals, frame.f_locals)
        variable = self._variable(expression, value)
        return {"result": variable["value"], "type": variable["type"],
                "variablesReference": variable["variablesReference"]}

    def _frame(self, args: dict):
        index = int(args.get("frameId") or 1) - 1
        if not 0 <= index < len(self._frames):
            raise LookupError(f"no frame {index + 1} in rank {self.link.rank}'s stack")
        return self._frames[index]

    def _ref(self, target) -> int:
        self._refs[len(self._refs) + 1] = target
        return len(self._refs)

    def _variable(self, name: str, value) -> dict:
        expandable = bool(_children(value)) if not _is_tensor(value) else True
        return {"name": name, "value": summary(value), "type": type(value).__name__, "evaluateName": name,
                "variablesReference": self._ref(value) if expandable else 0}

    # -- the receiving thread ------------------------------------------------------------------
    def on_request(self, request: protocol.DebugRequest) -> None:
        """A request from the kernel, on the link's receiving thread (the main thread may be busy)."""
        if request.command == "setBreakpoints":
            args = request.arguments
            self._reply(request, True, {"breakpoints": self.set_breakpoints(
                args["source"]["path"], args.get("breakpoints", []), args.get("content"))})
            if self.breaks and not self.armed and self._busy():  # the running code is traced from now on
                self._wake()
            return
        if request.command == "disconnect":
            self.clear_all_breaks()
        if request.command == "pause" and not self._paused:  # a stalled rank, looked at where it is
            if self._post_mortem or not self._busy():
                self._reply(request, self._post_mortem, {}, "" if self._post_mortem else
                            f"rank {self.link.rank} runs no code: there is nothing to pause")
            else:
                self._answer_post_mortem(request._replace(command="postMortem"))
            return
        if request.command == "postMortem" or self._post_mortem:
            self._answer_post_mortem(request)
            return
        with self._lock:
            if self._paused:
                self.requests.put(request)
                return
        if request.command == "disconnect":
            self._reply(request, True, {})
        else:
            self._refuse(request)

    def _answer_post_mortem(self, request) -> None:
        """The last failure's frames, opened in the panel: nothing runs there, so the receiving
        thread answers, and the main thread stays free for commands. A rank whose code is stuck
        (a stalled launch, kept for this) opens where its main thread waits, from its own frame."""
        if request.command == "postMortem":
            tb = None if self._busy() else self._last_failure()
            stuck = sys._current_frames().get(threading.main_thread().ident or 0) if self._busy() else None
            if tb is None and stuck is None:
                self._reply(request, False, {}, f"rank {self.link.rank} has no failure to debug")
                return
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            frames = _user_stack(tb.tb_frame if tb is not None else stuck)
            if stuck is not None:  # from the user's line that waits: torch's frames below it are C's callers
                while len(frames) > 1 and package_path(frames[0].f_code.co_filename) is not None:
                    frames.pop(0)
            self._frames, self._refs, self._post_mortem = frames, {}, True
            self._reply(request, True, {})
            self._emit(protocol.DebugEvent(self.link.rank, "stopped", {"reason": "exception" if tb else "pause"}))
        elif request.command in STEPS or request.command == "disconnect":
            self._frames, self._refs, self._post_mortem = [], {}, False
            self._reply(request, True, {"allThreadsContinued": False} if request.command == "continue" else {})
            self._emit(protocol.DebugEvent(self.link.rank, "continued", {}))
        else:
            self._answer_paused(request)

    def set_breakpoints(self, path: str, wanted: list[dict], content: str | None = None) -> list[dict]:
        """The breakpoints of one file, replacing its others (DAP's `setBreakpoints`)."""
        if content is not None:  # the cell as the kernel dumped it: bdb checks that a breakpoint's line exists
            linecache.cache[path] = (len(content), None, content.splitlines(keepends=True), path)
        self.clear_all_file_breaks(path)
        answers = []
        for breakpoint in wanted:
            line = int(breakpoint["line"])
            error = self.set_break(path, line, cond=breakpoint.get("condition") or None)
            answers.append({"verified": error is None, "line": line, **({"message": error} if error else {})})
        return answers

    def _refuse(self, request) -> None:
        self._reply(request, False, {}, f"rank {self.link.rank} is not stopped")

    # -- to the kernel ---------------------------------------------------------------------------
    def _reply(self, request, success: bool, body: dict, message: str = "") -> None:
        self._emit(protocol.DebugReply(self.link.rank, request.seq, success, body, message))

    def _emit(self, message) -> None:
        if self.link is not None:
            self.link.emit(message)


def look_while_stuck(link, command: protocol.Debug, make_pdb, main: int | None, busy) -> None:
    """`%debug` on a rank whose main thread is stuck in the user's code (a stalled launch kept for
    it): text pdb at the frames where it waits, on a thread of its own (the receiving thread
    brings the typed lines). Nothing runs in those frames: pdb looks, never steps. Answered as
    a command is, from `Begin` to its reply."""

    def look() -> None:
        from ..common.transfer import pack_exception, pack_result

        link.emit(protocol.Begin(link.rank, command.seq))
        reply: protocol.Returned | protocol.Raised
        try:
            frame = sys._current_frames().get(main) if main is not None else None
            if frame is None or not busy():
                raise RuntimeError(f"rank {link.rank}'s code is no longer running: there is nothing to look at.")
            debugger = make_pdb()
            debugger.cmdqueue.extend(command.commands)  # typed before the prompt, as if by the user
            debugger.typed = list(command.commands)
            debugger.reset()
            debugger.botframe = _user_stack(frame)[-1]  # `where` stops at the user's outermost frame
            debugger.interaction(frame, None)
            reply = protocol.Returned(link.rank, pack_result(None, link.rank), "")
        except Exception as exc:
            reply = protocol.Raised(link.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                                    pack_exception(exc))
        link.emit(reply)

    threading.Thread(target=look, name="nbtrain-stuck-pdb", daemon=True).start()


def _user_stack(frame) -> list:
    """The stopped frame and its callers, innermost first, down to the rank loop that called the user's code."""
    frames = []
    while frame is not None and frame.f_globals.get("__name__") != "nbtrain.rank.loop":
        frames.append(frame)
        frame = frame.f_back
    return frames


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a value can only be a tensor if torch is
    return torch is not None and isinstance(value, torch.Tensor)


def summary(value) -> str:
    """One line for the variables panel: a tensor by its shape, dtype and device, never its data."""
    if _is_tensor(value):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    try:
        return _repr.repr(value)
    except Exception as exc:  # a user's __repr__ that fails
        return f"<{type(value).__name__}: repr failed: {type(exc).__name__}: {exc}>"


def _children(value) -> list:
    """What the panel shows under a value: a tensor's description, items, attributes."""
    if _is_tensor(value):
        described = [("shape", tuple(value.shape)), ("dtype", value.dtype), ("device", value.device),
                     ("requires_grad", value.requires_grad)]
        return described + ([("values", value.tolist())] if value.numel() <= 100 else [])
    if isinstance(value, dict):
        return [(repr(k), v) for k, v in list(value.items())[:MAX_CHILDREN]]
    if isinstance(value, (list, tuple)):
        return list(enumerate(value[:MAX_CHILDREN]))
    if isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
        return []
    attributes = getattr(value, "__dict__", None)
    return [(k, v) for k, v in attributes.items() if not k.startswith("__")] if isinstance(attributes, dict) else []


DEBUGGER = RankDebugger()  # one per process; a rank forked from the kernel starts with its breakpoints
