"""Every message between the notebook and its ranks, and every event of a run, as named records.

Each record is a NamedTuple: fields have names (no code reads a message by position), and it is
still a tuple, cheap to pickle in a batch. Its class attribute `kind` (`@_kind`) is its name in a run's
event log and in the handlers that dispatch on it (`_on_<kind>`, `_do_<kind>`).

Ranks -> notebook, on the run's channel (`channel.Link.emit`), each naming its sender's `rank`:
  Hello, Begin, Returned, Raised, Need, Prompt        a rank's life and one command's
  Progress, Metric, BatchSize, Profile, StepTimes      what the training reports
  Whereabouts                                          where a rank is (the answer to `Where`)
  Display, UpdateDisplay, ClearOutput                  its rich output (IPython display)
  Output, Live, OutputEnd                              its printed lines, redrawn lines, a command's
                                                       output end (`output_reader.py`; read from
                                                       its pipes by the notebook, or forwarded)
  Closed                                               the notebook's own word: the link ended
Notebook -> rank: a command (`Run`, `Call`, `Exec`, `Eval`, `Push`, `Pull`, `Start`, `Debug`),
each with its `seq` and `everyone` (sent to every rank, so collectives may run in it), and
`Names` (the answer to a `Need`), `Interrupt`, `Stacks`, `Where`, `Stdin`, `Stop`.
A map's work queue, on a channel of its own: `WantItems`, `ItemsDone`, `ItemsFailed` from a
worker; `Items`, `NoMoreItems` back. The warm template, on its socket: `TemplateReady`, `Forked`,
`Exited`, `Pong`.

Run events: what a run's model (`notebook/run/runmodel.py`) tells its observers, and a submitted
run's event logs hold, one JSON object a line (`event_line`): `Hello`, `Progress`, `Metric`,
`BatchSize`, `Finished`, `Failed`, `Stopped`, `Vital`, `Output` per rank, and `AttemptStarted`,
`Note`, `AttemptEnded` for the run. Every log begins with a header naming its format's VERSION,
and so does run.json; `read_event` and `read_spec` are the one reader of every version: a log
without a header (version 1) holds `[attempt, kind, rank, *fields]` lists.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

VERSION = 2  # of a run directory's formats: the event logs and run.json
_Record = TypeVar("_Record")


def _kind(name: str) -> Callable[[type[_Record]], type[_Record]]:
    """Names a record: its class attribute `kind`, set here rather than in the class body, where a
    type checker takes every assignment in a NamedTuple for a field."""
    def named(cls: type[_Record]) -> type[_Record]:
        cls.kind = name  # type: ignore[attr-defined]
        return cls
    return named


# -- ranks -> notebook ---------------------------------------------------------------------------

@_kind("hello")
class Hello(NamedTuple):
    """A rank started: its process id and the machine it runs on, as it names itself."""
    rank: int
    pid: int | None
    host: str | None = None


@_kind("begin")
class Begin(NamedTuple):
    """A rank began the command `seq`."""
    rank: int
    seq: int


@_kind("result")
class Returned(NamedTuple):
    """A command's value (`transfer.pack_result`), and how the rank's code ended."""
    rank: int
    payload: bytes
    where: str = ""


@_kind("error")
class Raised(NamedTuple):
    """A command's exception: its first line, its traceback, and itself (`transfer.pack_exception`)."""
    rank: int
    summary: str
    traceback: str
    exception: bytes | None = None


@_kind("need")
class Need(NamedTuple):
    """The command `seq` reads names this rank lacks: the notebook answers with `Names`."""
    rank: int
    seq: int
    names: list[str]


@_kind("prompt")
class Prompt(NamedTuple):
    """A rank's debugger waits for a line of input: the notebook answers with `Stdin`."""
    rank: int
    text: str


@_kind("progress")
class Progress(NamedTuple):
    """One progress level's position; `at` is the rank's own clock (None: the notebook's, in
    process), `initial` where the loop began (a loop resumed from a checkpoint)."""
    rank: int
    level: int
    desc: str
    n: int
    total: int | None
    done: bool
    at: float | None = None
    initial: int = 0

    @property
    def begins(self) -> bool:
        """This event begins a loop: a loop's later events come only after a step, its last is `done`."""
        return self.n == self.initial and not self.done


@_kind("metric")
class Metric(NamedTuple):
    """A logged value (`ctx.log`); in `Result.history` too, in this order."""
    step: int
    rank: int
    name: Any  # a str, or whatever the user logged under (a tuple: a JSON list in the logs, a tuple again read back)
    value: float
    synced: bool


@_kind("batch_size")
class BatchSize(NamedTuple):
    rank: int
    per_rank: int
    effective: int


@_kind("profile")
class Profile(NamedTuple):
    """A profiled rank's summary (`rank/profiling.py`)."""
    rank: int
    summary: dict


@_kind("step_times")
class StepTimes(NamedTuple):
    """A rank's time in its last command, split (`rank/tally.py`): `batches` taken from ctx.loader,
    `total` seconds, of which `data` waiting for them and `collective` inside collectives; the rest
    is compute. `recent`: its last collectives, (seq, op, shape, dtype, file, line) each; `ddp`: its
    DDP forwards, as Whereabouts.ddp."""
    rank: int
    batches: int
    total: float
    data: float
    collective: float
    recent: list
    ddp: tuple = ()


@_kind("whereabouts")
class Whereabouts(NamedTuple):
    """Where a rank's main thread is (the answer to `Where`): `collectives` called so far, the one
    it is in (`current`, as in StepTimes.recent, or None), the user's file, line and its code, and
    the seconds since it last progressed (a collective or a batch done, a progress step), and
    where it meets its peers while its `init_process_group` has not completed (`rendezvous`); the
    backward() calls whose gradients DDP all-reduced, and what it is doing in the doctor's words
    ("loading data", "in the loop" or "left the loop" that calls backward(), or ""); `ddp`: its
    DDP models' training forwards (forwards, under no_sync(), not followed by backward(), and the
    parameters without a gradient), or () before any; `nccl`: on nccl, NCCL's Flight Recorder's
    last collective not completed, else its last (`rank/flight_recorder.summarise`), or ()."""
    rank: int
    collectives: int
    current: tuple | None
    file: str
    line: int
    code: str
    idle: float
    rendezvous: str = ""
    backwards: int = 0
    doing: str = ""
    ddp: tuple = ()
    nccl: tuple = ()


@_kind("display")
class Display(NamedTuple):
    """IPython display data a rank published (`rank/output.py`)."""
    rank: int
    data: dict
    metadata: dict
    transient: dict


@_kind("update_display")
class UpdateDisplay(NamedTuple):
    """An update of a display id a rank published earlier."""
    rank: int
    data: dict
    metadata: dict
    transient: dict


@_kind("clear_output")
class ClearOutput(NamedTuple):
    rank: int
    wait: bool


@_kind("output")
class Output(NamedTuple):
    """A whole line a rank printed (`stream`: stdout, stderr, or debug: its debugger talking)."""
    rank: int | None  # None: a launcher's own line (torchrun's)
    stream: str
    text: str


@_kind("live")
class Live(NamedTuple):
    """The lines a progress bar redraws, as they read now; `done`: they are final."""
    rank: int | None
    stream: str
    text: str
    done: bool


@_kind("output_end")
class OutputEnd(NamedTuple):
    """Everything `rank` wrote on `stream` during the command `seq` came before this."""
    rank: int | None
    stream: str
    seq: int


@_kind("closed")
class Closed(NamedTuple):
    """The rank's link closed: nothing more comes from it (put on the inbox by the notebook's Hub)."""
    rank: int


# Sent by a rank without waiting for a batch: the notebook acts on them (a new rich output too:
# it keeps its place among the lines printed around it).
URGENT = frozenset({Hello, Begin, Returned, Raised, Need, Prompt, Display, ClearOutput, Whereabouts})
RICH = (Display, UpdateDisplay, ClearOutput)  # what a display's `rich` takes


# -- notebook -> ranks ---------------------------------------------------------------------------

@_kind("run")
class Run(NamedTuple):
    """launch's function: (fn, args, kwargs) in memory (a fork), a dill payload, or a loader."""
    seq: int
    everyone: bool
    job: Any


@_kind("call")
class Call(NamedTuple):
    """A notebook function, run with the rank's namespace as its globals (`Ranks.run`)."""
    seq: int
    everyone: bool
    payload: bytes


@_kind("exec")
class Exec(NamedTuple):
    seq: int
    everyone: bool
    source: str
    filename: str
    want_repr: bool


@_kind("eval")
class Eval(NamedTuple):
    seq: int
    everyone: bool
    source: str


@_kind("push")
class Push(NamedTuple):
    seq: int
    everyone: bool
    payload: bytes


@_kind("pull")
class Pull(NamedTuple):
    seq: int
    everyone: bool
    name: str


@_kind("start")
class Start(NamedTuple):
    """Live ranks' first command: their process group."""
    seq: int
    everyone: bool


@_kind("debug")
class Debug(NamedTuple):
    seq: int
    everyone: bool
    commands: tuple | list = ()  # pdb commands typed first, as if by the user


COMMANDS = {cls.kind: cls for cls in (Run, Call, Exec, Eval, Push, Pull, Start, Debug)}  # type: ignore[union-attr]


def command(kind: str, seq: int, everyone: bool, *args):
    """The command `kind` (`Ranks`' name for it) with its arguments."""
    return COMMANDS[kind](seq, everyone, *args)


@_kind("names")
class Names(NamedTuple):
    """The names a `Need` asked for that the notebook has, pickled (None: none of them)."""
    seq: int
    payload: bytes | None


@_kind("interrupt")
class Interrupt(NamedTuple):
    """Raise KeyboardInterrupt in the command `seq`, if it still runs."""
    seq: int


@_kind("stacks")
class Stacks(NamedTuple):
    """Write every thread's stack to stderr (ranks on other machines; local ones get a signal)."""


@_kind("where")
class Where(NamedTuple):
    """Say where the main thread is (`Whereabouts`): the doctor's question when no rank progresses."""


@_kind("stdin")
class Stdin(NamedTuple):
    line: str


@_kind("stop")
class Stop(NamedTuple):
    """The rank's command loop ends."""


# -- a map's work queue --------------------------------------------------------------------------

@_kind("want_items")
class WantItems(NamedTuple):
    rank: int  # the worker's name on the queue: its rank, or its slot's number
    count: int  # type: ignore[assignment]  # shadows tuple.count, which no code calls on it; the name is the wire's


@_kind("items_done")
class ItemsDone(NamedTuple):
    rank: int
    indices: list[int]
    payload: bytes  # the results, one per index, pickled together


@_kind("items_failed")
class ItemsFailed(NamedTuple):
    rank: int
    indices: list[int]
    summary: str
    traceback: str
    exception: bytes | None = None


@_kind("items")
class Items(NamedTuple):
    batch: list  # (index, pickled item) pairs


@_kind("no_more_items")
class NoMoreItems(NamedTuple):
    """The queue is empty: the worker returns."""


URGENT |= {WantItems, ItemsDone, ItemsFailed}


# -- the warm template ---------------------------------------------------------------------------

@_kind("ready")
class TemplateReady(NamedTuple):
    pid: int


@_kind("forked")
class Forked(NamedTuple):
    pid: int


@_kind("exited")
class Exited(NamedTuple):
    pid: int
    code: int


@_kind("pong")
class Pong(NamedTuple):
    """The template is alive (the answer to a ping)."""


# -- run events ----------------------------------------------------------------------------------

@_kind("finished")
class Finished(NamedTuple):
    """The rank's command returned (`where`: how its code ended)."""
    rank: int
    where: str = ""


@_kind("failed")
class Failed(NamedTuple):
    rank: int
    summary: str
    traceback: str = ""
    crashed: bool = False  # died by a signal or exit code (or ended early), not by a Python exception


@_kind("stopped")
class Stopped(NamedTuple):
    """Stopped (or interrupted) because of another rank's failure or a time-out."""
    rank: int
    why: str = ""
    stack: str = ""


@_kind("vital")
class Vital(NamedTuple):
    """One rank's vital signs at one moment, sampled in the notebook at most about once a second."""
    time: float  # seconds since the run started
    rank: int
    step_rate: float | None  # steps/s at the innermost progress level, over the last few seconds
    rss: int | None  # bytes: the rank process's resident memory
    gpu_memory: int | None  # bytes: GPU memory held by the rank's process (NVML)
    gpu_util: int | None  # percent: utilisation of the rank's GPU (NVML)
    gpu: int | None  # physical index of the rank's GPU


@_kind("start")
class AttemptStarted(NamedTuple):
    """An attempt of a submitted run began: its title, its ranks, the wall clock."""
    title: str
    ranks: list[int]
    time: float


@_kind("note")
class Note(NamedTuple):
    text: str


@_kind("end")
class AttemptEnded(NamedTuple):
    ok: bool
    time: float


RUN_EVENTS = (AttemptStarted, Note, AttemptEnded)  # the run's own log (events.jsonl)
RANK_EVENTS = (Hello, Progress, Metric, BatchSize, Finished, Failed, Stopped, Vital, Output)  # rank-N.jsonl
LOGGED = {cls.kind: cls for cls in (*RUN_EVENTS, *RANK_EVENTS)}  # type: ignore[union-attr]  # set by @_kind


class Logged(NamedTuple):
    """An event read back from a log, with the restart attempt it belongs to."""
    attempt: int
    event: Any


# -- on disk -------------------------------------------------------------------------------------

HEADER = "nbtrain-events"  # a log's first line: {"log": HEADER, "version": VERSION}


def header_line() -> bytes:
    return (json.dumps({"log": HEADER, "version": VERSION}) + "\n").encode()


def event_line(attempt: int, event) -> bytes:
    """One event as a line of its log: {"attempt": ..., "kind": ..., and its fields by name}."""
    return (json.dumps({"attempt": attempt, "kind": event.kind, **event._asdict()}, default=repr) + "\n").encode()


def log_version(value) -> int | None:
    """The version a log's first line names; None when it is no header (version 1 had none)."""
    if isinstance(value, dict) and value.get("log") == HEADER:
        version = value.get("version")
        if not isinstance(version, int) or not 1 <= version <= VERSION:
            raise ValueError(f"a run log of format {version!r}: this nbtrain reads formats 1 to {VERSION} "
                             "(a newer nbtrain wrote it)")
        return version
    return None


# Version 1 wrote `[attempt, kind, rank, *fields]`: the rank first, then these fields in order.
_V1_FIELDS = {
    "start": ("title", "ranks", "time"), "note": ("text",), "end": ("ok", "time"),
    "hello": ("pid", "host"), "progress": ("level", "desc", "n", "total", "done", "at", "initial"),
    "metric": ("step", "name", "value", "synced"), "batch_size": ("per_rank", "effective"),
    "finished": ("where",), "failed": ("summary", "traceback", "crashed"), "stopped": ("why", "stack"),
    "vital": ("time", "step_rate", "rss", "gpu_memory", "gpu_util", "gpu"), "output": ("stream", "text"),
}


def read_event(value, version: int) -> Logged | None:
    """A log line's JSON value, of any version, as the event it records; None for a line that
    is not one (a line of another program, a kind this nbtrain does not know)."""
    if version == 1:
        if not isinstance(value, list) or len(value) < 3 or value[1] not in _V1_FIELDS:
            return None
        attempt, kind, rank, *payload = value
        names = _V1_FIELDS[kind]
        if len(payload) > len(names):
            return None
        fields = dict(zip(names, payload))
        if LOGGED[kind] not in RUN_EVENTS:
            fields["rank"] = rank
    elif isinstance(value, dict) and value.get("kind") in LOGGED:
        attempt, kind = value.get("attempt"), value["kind"]
        fields = {k: v for k, v in value.items() if k not in ("attempt", "kind")}
    else:
        return None
    if not isinstance(attempt, int):
        return None
    if kind == "metric" and isinstance(fields.get("name"), list):  # a tuple, as JSON holds it
        fields["name"] = tuple(fields["name"])
    try:
        return Logged(attempt, LOGGED[kind](**fields))
    except TypeError:  # fields missing, or not this kind's
        return None


def spec(value: dict) -> dict:
    """run.json's content as written: with the VERSION of the run directory's formats."""
    return {**value, "version": VERSION}


def read_spec(value: dict, path: str) -> dict:
    """run.json's content, of any version (1 had none), as this version reads it."""
    version = value.get("version", 1)
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ValueError(f"{path!r} is of format {version!r}: this nbtrain reads formats 1 to {VERSION} (a newer "
                         "nbtrain wrote it)")
    return {**value, "version": version}


# Classes a pickle in an older run directory names where they were then (result.pkl's Result
# holds Metric and Vital records).
MOVED = {("nbtrain.display.runstate", "Metric"): Metric, ("nbtrain.display.runstate", "Vital"): Vital}
# Modules of the notebook side that moved into its wings (0.2): a run directory's pickles (a launch's
# Result, a submitted sweep's Sweep and its state) name their classes' modules as they were then.
MOVED_MODULES = {
    "nbtrain.notebook.background": "nbtrain.notebook.run.background",
    "nbtrain.notebook.cell": "nbtrain.notebook.ipython.cell",
    "nbtrain.notebook.chatter": "nbtrain.notebook.run.chatter",
    "nbtrain.notebook.choices": "nbtrain.notebook.run.choices",
    "nbtrain.notebook.debugger": "nbtrain.notebook.run.debugger",
    "nbtrain.notebook.detached": "nbtrain.notebook.detached.supervise",
    "nbtrain.notebook.doctor": "nbtrain.notebook.run.doctor",
    "nbtrain.notebook.env": "nbtrain.notebook.ipython.env",
    "nbtrain.notebook.export": "nbtrain.notebook.detached.export",
    "nbtrain.notebook.exported_job": "nbtrain.notebook.detached.exported_job",
    "nbtrain.notebook.inprocess": "nbtrain.notebook.run.inprocess",
    "nbtrain.notebook.insight": "nbtrain.notebook.run.insight",
    "nbtrain.notebook.launch": "nbtrain.notebook.run.launch",
    "nbtrain.notebook.magic_options": "nbtrain.notebook.ipython.magic_options",
    "nbtrain.notebook.magics": "nbtrain.notebook.ipython.magics",
    "nbtrain.notebook.mapping": "nbtrain.notebook.many.mapping",
    "nbtrain.notebook.options": "nbtrain.notebook.run.options",
    "nbtrain.notebook.pool": "nbtrain.notebook.run.pool",
    "nbtrain.notebook.ranks": "nbtrain.notebook.live.ranks",
    "nbtrain.notebook.ranks_magics": "nbtrain.notebook.ipython.ranks_magics",
    "nbtrain.notebook.reloads": "nbtrain.notebook.run.reloads",
    "nbtrain.notebook.restarts": "nbtrain.notebook.run.restarts",
    "nbtrain.notebook.result": "nbtrain.notebook.run.result",
    "nbtrain.notebook.runmodel": "nbtrain.notebook.run.runmodel",
    "nbtrain.notebook.runs": "nbtrain.notebook.detached.runs",
    "nbtrain.notebook.slots": "nbtrain.notebook.many.slots",
    "nbtrain.notebook.stacks": "nbtrain.notebook.run.stacks",
    "nbtrain.notebook.steer": "nbtrain.notebook.run.steer",
    "nbtrain.notebook.steer_files": "nbtrain.notebook.run.steer_files",
    "nbtrain.notebook.submit": "nbtrain.notebook.detached.submit",
    "nbtrain.notebook.supervisor": "nbtrain.notebook.run.supervisor",
    "nbtrain.notebook.sweep": "nbtrain.notebook.many.sweep",
    "nbtrain.notebook.sweep_study": "nbtrain.notebook.many.sweep_study",
    "nbtrain.notebook.sweep_trials": "nbtrain.notebook.many.sweep_trials",
    "nbtrain.notebook.work_queue": "nbtrain.notebook.live.work_queue",
}


# -- a sweep's trials: Optuna's trial, asked from a rank (`rank/trial.py`), on a channel of its own

@_kind("trial_ask")
class TrialAsk(NamedTuple):
    rank: int  # the asker's name on the sweep's channel (its trial's number and its rank)
    trial: int  # the trial's number
    method: str  # what of optuna.trial.Trial: 'suggest_float', 'report', 'should_prune', 'params', ...
    args: tuple
    kwargs: dict


@_kind("trial_answer")
class TrialAnswer(NamedTuple):
    value: Any
    error: bytes | None = None  # what Optuna raised (`transfer.pack_exception`), raised again in the rank


URGENT |= {TrialAsk}


# -- steering a run while it trains (`rank/steer.py`, `notebook/run/steer.py`) ------------------------
# Notebook -> rank, on the run's channel (handled by the rank's listener thread): SteerHold,
# SteerApply, SteerResume. Rank -> notebook: SteerHeld, SteerDone. A `Change` is a run event.

@_kind("steer_hold")
class SteerHold(NamedTuple):
    """Hold at a step boundary: the next one (`step` None), or the first at or past `step` (the agreed one)."""
    step: int | None = None


@_kind("steer_apply")
class SteerApply(NamedTuple):
    """For a held rank: `what` ('call', 'set', 'checkpoint', 'stop') with its pickled arguments; numbered `seq`."""
    seq: int
    what: str
    payload: bytes | None = None


@_kind("steer_resume")
class SteerResume(NamedTuple):
    """Go on from the boundary the rank holds at (or stop holding for one it has not reached)."""


@_kind("steer_held")
class SteerHeld(NamedTuple):
    """A rank holds at the boundary after `step` steps of its current command; `held` False: the
    listener's answer as the hold came, `step` boundaries passed and the rank inside the next step."""
    rank: int
    step: int
    held: bool = True


@_kind("steer_done")
class SteerDone(NamedTuple):
    """A held rank did `SteerApply` `seq` at `step`: its answer (`transfer.pack_result`), or its error's traceback."""
    rank: int
    seq: int
    step: int
    payload: bytes | None = None
    error: str = ""


@_kind("change")
class Change(NamedTuple):
    """A run event: what was changed while the run trained (`what`: 'pause', 'call', 'set', 'checkpoint',
    'stop', 'resume'), at which step (every rank's), in words, and when (the notebook's time.time());
    `args`, what it was made with as data, where an exported job can make it again (`rank/steer.Replay`):
    a set's {'values': {...}, 'optimizer': name or None}, a checkpoint's {'path': ...}."""
    step: int
    what: str
    detail: str
    time: float
    args: dict | None = None


STEER_REPLIES = (SteerHeld, SteerDone)
URGENT |= set(STEER_REPLIES)
RUN_EVENTS += (Change,)  # type: ignore[assignment]  # in the run's own log: a kernel that attaches marks it on the chart too
LOGGED[Change.kind] = Change  # type: ignore[assignment, attr-defined]  # kind: set by @_kind


# -- the notebook's visual debugger on the ranks (notebook/run/debugger.py <-> rank/debugger.py) ------

@_kind("debug_request")
class DebugRequest(NamedTuple):
    """Notebook -> rank: a Debug Adapter Protocol request (`command`, `arguments`) for the rank's
    debugger; its frame ids and variable references are the rank's own. Answered by a `DebugReply`."""
    seq: int
    command: str
    arguments: dict


@_kind("debug_reply")
class DebugReply(NamedTuple):
    """Rank -> notebook: the answer to the `DebugRequest` `seq` (a DAP response's body, or why not)."""
    rank: int
    seq: int
    success: bool
    body: dict
    message: str = ""


@_kind("debug_event")
class DebugEvent(NamedTuple):
    """Rank -> notebook: a DAP event of the rank's debugger (`stopped`, `continued`) and its body."""
    rank: int
    event: str
    body: dict


DEBUGGER = (DebugReply, DebugEvent)  # what the notebook's debugger takes, never a command's watcher
URGENT = URGENT | frozenset(DEBUGGER)  # a paused rank waits for the panel's next request
