"""The rank side of every run: receive a command, run it in this rank, stream events, reply.

One loop serves `launch` (one `run` command, then the rank exits) and live `Ranks` (commands
until `stop`), whatever started the rank. Commands run on the main thread, so an interrupt
(SIGINT, raised only while user code runs) lands in the user's code as KeyboardInterrupt; the
channel's second thread receives commands, interrupts, stack requests, the doctor's `Where`
(answered from there: `doctor.py`, and on nccl `flight_recorder.py`) and debugger input.

The messages both ways are `common/protocol.py`'s records. A command (`Run`, `Call`, `Exec`,
`Eval`, `Push`, `Pull`, `Start`, `Debug`) carries its `seq` and `everyone` (sent to every rank, so
collectives — the gather of a sharded model — may run); `_do_<kind>` runs it. The rank answers
`Begin`, then `Returned` or `Raised`; code that reads a name the rank lacks sends `Need` (answered
by `Names`), its debugger `Prompt` (answered by `Stdin`). `Interrupt`, `Stacks` and `Stop` come on
the same link, and so do steering's (`SteerHold`, `SteerApply`, `SteerResume`: `steer.py`). What
user code displays travels beside them (`output.py`). A failure's reply keeps the user's frames
(`failures.py`); pdb on a rank talks through the notebook (`remote_pdb.py`). Every frame between
the loop and the user's code is this module's: the debugger and `failures.user_frames` tell the
user's frames by that.
"""
from __future__ import annotations

import ast
import builtins
import faulthandler
import gc
import linecache
import os
import queue
import signal
import socket
import sys
import threading
import types

from ..common import protocol
from ..common.channel_dial import ChannelUnreachable
from ..common.channel_link import Link
from ..common.pickling_parts import code_global_names
from ..common.process_tree import become_subreaper, end_descendants
from ..common.source import free_names, parse_cell
from ..common.transfer import pack_exception, pack_result, unpack_job, unpack_push
from .compat import become_torchrun_worker, destroy_asked_group
from .context import Context, set_current
from .debugger import DEBUGGER, look_while_stuck
from .doctor import count_collectives, whereabouts
from .failures import cut_inherited, exit_site, note_inherited, user_frames, user_traceback
from .flight_recorder import summary as nccl_summary
from .flight_recorder import turn_on as turn_on_flight_recorder
from .output import show_in_notebook
from .process import enable_stacks, end_output, limit_threads, watched_from_here
from .process import forward_output as forward
from .remote_pdb import RemoteDebugger
from .rendezvous import use_private_store
from .strategies import contains_sharded
from .tally import TALLY

NOTHING = object()  # an exec whose code ends without an expression
STEERING = (protocol.SteerHold, protocol.SteerApply, protocol.SteerResume)  # `rank/steer.py`'s


class RankLoop:
    def __init__(self, ctx, link, live: bool, exits: bool = False):
        self.ctx, self.link, self.live = ctx, link, live
        self.exits = exits  # the process ends with os._exit once it replied: its group goes with it
        self.commands: queue.Queue = queue.Queue()
        self.names: queue.Queue = queue.Queue()
        self.stdin: queue.Queue = queue.Queue()
        # None only in a rank that is not live, where no command that reads it comes
        self.namespace: dict = _fresh_main(ctx) if live else None  # type: ignore[assignment]
        self.borrowed: dict[str, object] = {}  # names taken from the notebook, as they came
        self.last_traceback = None
        self._lock = threading.Lock()
        self._running: int | None = None  # seq of the command whose user code runs now
        self._interrupting = False
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGINT, self._on_sigint)
        if live:
            sys.breakpointhook = self._breakpoint
        self._arming = False
        DEBUGGER.attach(link, lambda: self.last_traceback, self.busy, self._arm)  # the notebook's visual debugger

    def busy(self) -> bool:
        """The main thread runs user code (or waits in it: a collective, a stalled launch)."""
        with self._lock:
            return self._running is not None

    def _arm(self) -> None:
        """Breakpoints set while user code runs: its main thread arms the debugger, in `_on_sigint`
        (only while that handler is SIGINT's: another's would take the signal for a Ctrl-C)."""
        ours = signal.getsignal(signal.SIGINT) == self._on_sigint
        with self._lock:
            if ours and self._running is not None and self._main is not None:
                self._arming = True
                signal.pthread_kill(self._main, signal.SIGINT)

    # -- the receiving thread ------------------------------------------------------------
    def on_message(self, message) -> None:
        if isinstance(message, protocol.Interrupt):
            with self._lock:
                if self._running is not None and self._running == message.seq and self._main is not None:
                    self._interrupting = True
                    signal.pthread_kill(self._main, signal.SIGINT)
        elif isinstance(message, protocol.Stacks):
            # remote ranks; local ones are asked by signal (works even when the GIL is held)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        elif isinstance(message, protocol.Where):  # answered here: the main thread may be stuck
            self.link.emit(whereabouts(self.link.rank)._replace(nccl=nccl_summary()))  # () but on nccl
        elif isinstance(message, protocol.Stdin):
            self.stdin.put(message.line)
        elif isinstance(message, protocol.Names):
            self.names.put(message)
        elif isinstance(message, STEERING):  # the main thread finds it at its next step boundary
            self.ctx._steering.on_message(message)
        elif isinstance(message, protocol.DebugRequest):  # the notebook's visual debugger
            DEBUGGER.on_request(message)
        elif isinstance(message, protocol.Debug) and self.busy():  # stuck (a stalled launch): its frames as they are
            look_while_stuck(self.link, message, lambda: RemoteDebugger(self, stuck=True), self._main, self.busy)
        else:
            self.commands.put(message)

    def _on_sigint(self, signum, frame) -> None:
        # Only an interrupt asked for the running command counts: a late one, arriving after
        # the user's code returned, must not break the reply or the next command.
        if self._arming:
            self._arming = False
            DEBUGGER.arm_running(frame)
        if self._interrupting:
            self._interrupting = False
            raise KeyboardInterrupt

    # -- the main thread -----------------------------------------------------------------
    def serve(self, first=None, once: bool = False) -> int:
        """Run commands until `Stop` (or, with `once`, after the first); the exit code."""
        if first is not None:
            self.commands.put(first)
        code = 0
        while True:
            command = self.commands.get()
            if isinstance(command, protocol.Stop):
                return code
            code = self._execute(command, once)
            del command  # a pushed 500 MB payload, unpickled already, is not kept until the next command
            if once:
                return code

    def _execute(self, command, once: bool) -> int:
        rank, seq = self.link.rank, command.seq
        self.ctx._begin_command()
        TALLY.reset()
        self.link.emit(protocol.Begin(rank, seq))
        handler = getattr(self, f"_do_{command.kind}", None)
        reply: protocol.Returned | protocol.Raised
        try:
            if handler is None:
                raise ValueError(f"unknown command {command.kind!r}")
            value, where = handler(command)
            destroy_asked_group()  # the user's destroy_process_group(), now that the command's objects are freed
            if once or isinstance(command, (protocol.Call, protocol.Pull, protocol.Eval)):
                value = self._ready_to_leave(value, command.everyone)
            if once and not self.exits:  # (the group's teardown, ~20 ms of gloo's, is the OS's then)
                self.ctx.close()
            reply, code = protocol.Returned(rank, self._pack(value), where), 0
        except BaseException as exc:  # KeyboardInterrupt included: the notebook must hear of it
            cut_inherited(exc)
            self.last_traceback = user_frames(exc.__traceback__, __file__)
            reply, code = protocol.Raised(rank, f"{type(exc).__name__}: {exc}", user_traceback(exc, __file__),
                                          pack_exception(exc)), 1
        finally:
            with self._lock:
                self._running, self._interrupting = None, False
        if TALLY.seq or TALLY.batches:  # what the doctor compares across ranks: before the reply
            self.link.emit(TALLY.step_times(rank))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # Printed output travels on pipes of its own: the end mark lets the notebook show all of a
        # live rank's in this command's cell (a launch's ends with its process).
        end_output(seq, marked=not once)
        if once:
            self.link.close(reply)
        else:
            self.link.emit(reply)
        return code

    def _ready_to_leave(self, value, everyone: bool):
        """Sharded models gathered whole (a collective: only when every rank took the command)."""
        if not everyone and contains_sharded(value):
            raise ValueError("a sharded (fsdp) model is gathered by every rank together: take it from all ranks "
                             "(ranks.pull('model'), ranks.run(fn)), not from some of them.")
        return self.ctx.prepare_return(value) if everyone else value

    def _user_code(self, seq: int):
        """Marks the span in which an interrupt for `seq` may land (see `_on_sigint`)."""
        loop = self

        class _Span:
            def __enter__(self):
                with loop._lock:
                    loop._running = seq
                DEBUGGER.arm()  # traced only while a breakpoint is set

            def __exit__(self, *exc):
                DEBUGGER.disarm()
                with loop._lock:
                    loop._running, loop._interrupting = None, False

        return _Span()

    def _pack(self, value) -> bytes:
        return pack_result(value, self.ctx.rank, keep=self.live)

    # -- commands ------------------------------------------------------------------------
    def _do_run(self, command: protocol.Run):
        job = command.job
        if isinstance(job, bytes):
            job = unpack_job(job)
        elif callable(job):  # a loader (script mode reads the payload from its job directory)
            job = job()
        fn, args, kwargs = job
        with self._user_code(command.seq):
            try:
                value = fn(*args, **kwargs)
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
                return None, f"called sys.exit({exc.code if exc.code is not None else ''}) at {exit_site(exc)}"
        return value, f"returned from {getattr(fn, '__qualname__', 'the function')}()"

    def _do_call(self, command: protocol.Call):
        import dill

        # trackers and a profile around the call (Ranks.run), or None
        bare, args, kwargs, insight = dill.loads(command.payload)
        self._fetch_missing(command.seq, code_global_names(bare.__code__))
        fn = types.FunctionType(bare.__code__, self.namespace, bare.__name__, bare.__defaults__, bare.__closure__)
        fn.__kwdefaults__, fn.__qualname__ = bare.__kwdefaults__, bare.__qualname__
        with self._user_code(command.seq):
            value = fn(*args, **kwargs) if insight is None else insight.around(lambda: fn(*args, **kwargs))
        return value, f"returned from {fn.__qualname__}()"

    def _do_exec(self, command: protocol.Exec):
        source, filename = command.source, command.filename
        lines = source.splitlines(keepends=True)
        linecache.cache[filename] = (len(source), None, lines, filename)
        self._fetch_missing(command.seq, free_names(source, filename))
        code = _compile_cell(source, filename)
        with self._user_code(command.seq):
            exec(code, self.namespace)
        value = self.namespace.pop(_LAST, NOTHING)
        if value is NOTHING or value is None or not command.want_repr:
            return None, ""
        return repr(value), ""

    def _do_eval(self, command: protocol.Eval):
        source, filename = command.source, "<nbtrain eval>"
        linecache.cache[filename] = (len(source), None, [source], filename)

        self._fetch_missing(command.seq, free_names(source, filename))
        code = compile(source, filename, "eval")
        with self._user_code(command.seq):
            return eval(code, self.namespace), ""

    def _do_push(self, command: protocol.Push):
        self.namespace.update(unpack_push(command.payload))
        return None, ""

    def _do_pull(self, command: protocol.Pull):
        if command.name not in self.namespace:
            raise NameError(f"name {command.name!r} is not defined on rank {self.ctx.rank}")
        return self.namespace[command.name], ""

    def _do_start(self, command: protocol.Start):
        with self._user_code(command.seq):  # a rendezvous that never completes can be interrupted
            self.ctx.start_group()
        return None, ""

    def _do_debug(self, command: protocol.Debug):
        if self.last_traceback is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no failure to debug: nothing raised since the ranks started.")
        debugger = RemoteDebugger(self)
        debugger.cmdqueue.extend(command.commands)  # typed before the prompt, as if by the user
        debugger.typed = list(command.commands)
        with self._user_code(command.seq):
            debugger.reset()
            debugger.interaction(None, self.last_traceback)
        return None, ""

    def _breakpoint(self, *args, **kwargs) -> None:
        """`breakpoint()` in code running on a live rank: pdb, through the notebook."""
        RemoteDebugger(self).set_trace(sys._getframe(1))  # type: ignore[attr-defined]  # __new__ gives a Pdb

    # -- names the rank lacks ------------------------------------------------------------
    def _fetch_missing(self, seq: int, names) -> None:
        """Ask the notebook for the names this code reads that this rank does not have.

        The rank's own names win: state that lives here is never overwritten from the notebook.
        Names it took from the notebook and left as they came are asked for again, so they follow
        the notebook when it redefines them (the notebook sends only what it rebound since).
        """
        names = list(dict.fromkeys(names))
        for name in [n for n in names if n in self.borrowed]:
            if self.namespace.get(name, NOTHING) is not self.borrowed[name]:
                del self.borrowed[name]  # the rank rebound it: its own now
        missing = [n for n in names if (n not in self.namespace and not hasattr(builtins, n)) or n in self.borrowed]
        if not missing:
            return
        self.link.emit(protocol.Need(self.link.rank, seq, missing))
        with self._user_code(seq):
            while True:
                answer = self.names.get()
                if answer.seq == seq:
                    break
        if answer.payload is not None:
            import dill

            received = dill.loads(answer.payload)
            self.namespace.update(received)
            self.borrowed.update(received)


# -- helpers ------------------------------------------------------------------------------

def _fresh_main(ctx) -> dict:
    """A live rank's namespace: a new `__main__` module, so what is defined there pickles by
    reference (DataLoader workers, results) as it would in a notebook."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, ctx=ctx)
    sys.modules["__main__"] = main
    return main.__dict__


_LAST = "<nbtrain last value>"  # not an identifier: no name of the user's can clash with it


def _compile_cell(source: str, filename: str):
    """The code as one code object whose last expression, if it ends with one, is kept in
    `_LAST`, as a cell shows its last value. One code object: a debugger stepping through the
    cell sees it run to its end, not a body that returns before its last line."""
    tree = parse_cell(source, filename)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(_LAST, ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec")


NOTICE_VAR = "NBTRAIN_NOTICE"  # a line for the notebook from a remote rank's start (see serve)


def serve(first=None, once: bool = False, live: bool = False, forward_output: bool = False,
          exits: bool = False) -> int:
    """Be a rank (environment already set): connect, say hello, run commands; the exit code.

    `forward_output`: this rank has no pipe to the notebook (another machine): its fds 1 and 2
    travel over the channel instead. `exits`: the caller ends the process with `os._exit` as
    this returns (no destructor runs), so the process group is left to the OS.
    """
    note_inherited()
    # What the rank inherited (a fork of the kernel: its whole heap) or imported is never garbage a
    # collection must find: frozen, a collection (the user's destroy_process_group's, Python's own
    # oldest generation's) walks only what the rank makes, in milliseconds, not a second.
    gc.freeze()
    rank = int(os.environ["RANK"])
    try:
        link = Link.from_environ(rank)
    except ChannelUnreachable as exc:  # one line on stderr: the notebook shows it as the rank's failure
        print(f"nbtrain: {exc}", file=sys.stderr, flush=True)
        return 1
    assert link is not None, "a rank nbtrain starts always has its notebook's address"
    if forward_output:
        forward(link)
        notice = os.environ.pop(NOTICE_VAR, None)
        if notice:  # what the engine's side found as the rank started, now that its output reaches the notebook
            print(f"nbtrain: {notice}", file=sys.stderr, flush=True)
    become_torchrun_worker()
    use_private_store()
    count_collectives()
    turn_on_flight_recorder()  # on nccl, before the process group is made
    show_in_notebook(link, rank)
    ctx = Context.from_environ(os.environ, link)
    set_current(ctx)
    loop = RankLoop(ctx, link, live, exits)
    link.listen(loop.on_message, _notebook_gone)
    link.emit(protocol.Hello(rank, os.getpid(), socket.gethostname()))
    become_subreaper()  # what the code starts, in a session of its own or orphaned, stays in reach
    watched_from_here()  # before any code that may start a process runs
    try:
        return loop.serve(first, once)
    finally:
        end_descendants()


def _notebook_gone() -> None:
    """The channel closed: the notebook is gone (its kernel killed, say). This rank ends, and
    what its code started first."""
    end_descendants()
    os._exit(1)


def remote_main(environ: dict, first, live: bool) -> int:
    """A rank started by a remote engine (a SLURM task, a Ray actor) in a process of its own:
    `environ` holds the torchrun-standard variables and the channel's address and authkey."""
    os.environ.update(environ)
    enable_stacks()
    limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return serve(first, once=not live, live=live, forward_output=True)
