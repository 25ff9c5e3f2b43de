"""`strategy=` and `start=`: the words each takes, the old combined names, and the pair a run resolves to.

`strategy` is how `ctx.setup` wraps a model (DDP, FSDP2, DataParallel, DeepSpeed's own); `start` is
where the rank processes come from (a fork of this kernel, a fork of the warm template, a fresh
interpreter, a script under torchrun; the words and their placements are `starts.py`'s table).
Every front end (`launch`, `submit`, `Ranks`, `sweep`, the magics) reads its two words through
`words` here, so an old name means the same pair everywhere and is said once per kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...common.devices import DevicePlan
from ...common.preflight import check_fork, fork_blocker
from .starts import IN_KERNEL, LIVE_STARTS, STARTS, StartWords, entry

STRATEGIES = ("auto", "ddp", "fsdp", "dp", "deepspeed")
# The combined names of earlier releases: (strategy, start). `launcher_options={"template": ...}`
# is the other old way to say a start.
ALIASES = {
    "ddp_fork": ("ddp", "fork"),
    "ddp_notebook": ("ddp", "fork"),
    "fork": ("ddp", "fork"),
    "ddp_spawn": ("ddp", "template"),
    "spawn": ("ddp", "template"),
    "ddp_script": ("ddp", "torchrun"),
}
TEMPLATE_OPTION = {True: "template", False: "spawn"}
SCRIPT_SETTINGS = "node_rank, rdzv_endpoint, max_restarts, launcher"
_said: set[str] = set()  # the alias lines this kernel has said


@dataclass
class Words:
    """What was asked, in the new words: strategy, start, the launcher's settings (None: none
    given), and one line per old name used (each said once per kernel)."""
    strategy: str
    start: str
    options: dict | None
    aliases: tuple[str, ...] = ()
    start_said: str = ""  # how the start was given, for errors: "start='fork'", "strategy='ddp_fork' (start='fork')"

    def __post_init__(self):
        self.start_said = self.start_said or f"start={self.start!r}"

    def say(self, note=None) -> None:
        """Say each alias line this kernel has not said yet: through `note` (a display's), else printed."""
        for line in self.aliases:
            if line not in _said:
                _said.add(line)
                note(line) if note is not None else print(f"nbtrain: {line}")


@dataclass(frozen=True)
class Choice:
    """The pair a run resolves to: `strategy` ('single', 'dp', 'ddp', 'fsdp', 'deepspeed') and
    `start` ('kernel', 'fork', 'template', 'spawn', 'torchrun'), the launcher's settings, and a
    one-line note on what 'auto' chose (None when nothing was left to it)."""
    strategy: str
    start: str
    options: dict
    note: str | None = None


def _accepted(names) -> str:
    return ", ".join(repr(n) for n in names)


def words(strategy="auto", start="auto", launcher_options: dict | None = None) -> Words:
    """The request in the new words: old names replaced by their pair, `{"template": bool}` by its start.

    Raises ValueError (one line, naming both arguments where they disagree) for unknown words.
    """
    if not isinstance(strategy, str) or strategy not in (*STRATEGIES, *ALIASES):
        raise ValueError(f"strategy={strategy!r} is not known. Accepted: {_accepted(STRATEGIES)} "
                         f"(earlier names, still understood: {_accepted(ALIASES)}).")
    if not isinstance(start, str) or start not in STARTS:
        raise ValueError(f"start={start!r} is not known. Accepted: {STARTS!r}; a cluster is "
                         "cluster=nbtrain.Slurm(...) or nbtrain.Ray(...).")
    if launcher_options is not None and not isinstance(launcher_options, dict):
        raise TypeError(f"launcher_options={launcher_options!r}: give a dict of torchrun's settings "
                        f"({SCRIPT_SETTINGS}), or None.")
    aliases, said = [], ""
    if strategy in ALIASES:
        pair = ALIASES[strategy]
        if start not in ("auto", pair[1]):
            raise ValueError(f"strategy={strategy!r} with start={start!r}: {strategy!r} is the earlier name of "
                             f"strategy={pair[0]!r}, start={pair[1]!r}; give strategy={pair[0]!r}, start={start!r}.")
        aliases.append(f"strategy={strategy!r} is strategy={pair[0]!r}, start={pair[1]!r} (the earlier name "
                       "still works)")
        said = f"strategy={strategy!r} (start={pair[1]!r})"
        strategy, start = pair
    options = None if launcher_options is None else dict(launcher_options)
    if options is not None and "template" in options:
        template = options.pop("template")
        if not isinstance(template, bool):
            raise ValueError(f"launcher_options={{'template': {template!r}}}: give True (start='template') or "
                             "False (start='spawn').")
        if start not in ("auto", "template"):
            raise ValueError(f"launcher_options={{'template': {template!r}}} with start={start!r}: the option is "
                             f"the earlier way to say start={TEMPLATE_OPTION[template]!r}; give start= alone.")
        start = TEMPLATE_OPTION[template]
        said = f"launcher_options={{'template': {template}}} (start={start!r})"
        aliases.append(f"launcher_options={{'template': {template}}} is start={start!r} (the earlier way still "
                       "works)")
        options = options or None  # nothing else given: no launcher settings
    return Words(strategy, start, options, tuple(aliases), said)


USES = ("launch", "live", "slot")  # where a run's ranks are asked for: a launch (or a cell), live ranks, a slot
LIVE_WRAPPINGS = ("auto", "ddp", "fsdp")  # what live ranks wrap models with ('auto' is 'ddp')


def choose(asked: Words, plan: DevicePlan | None, use: str = "launch") -> Choice:
    """The (strategy, start) a request resolves to where it is used, with a note on what 'auto' chose.

    The one resolver of every front end: `use` is "launch" (`launch`, `submit`, `%%nbtrain`),
    "live" (`Ranks`, `%%ranks`) or "slot" (a sweep's or a map's runs, started from threads; `plan`
    may be None, each slot plans its own). The start it returns is a word of `starts.py`'s table
    (or 'kernel'); `starts.launcher_for` makes its launcher. Refusals are ValueErrors naming the
    arguments and what is accepted.
    """
    if use == "live":
        return _live(asked)
    if use == "slot":
        return _slot(asked)
    if use != "launch" or plan is None:
        raise ValueError(f"use={use!r} (plan {plan!r}): give one of {USES} and, for a launch, the device plan.")
    return _launch(asked, plan)


def _live(asked: Words) -> Choice:
    """Live ranks: a wrapping of theirs, a start that can host them; 'auto' is a fork when that is
    safe, else the warm template (whose note says why)."""
    if asked.strategy not in LIVE_WRAPPINGS:
        raise ValueError(f"strategy={asked.strategy!r}: live ranks wrap models with "
                         f"{', '.join(map(repr, LIVE_WRAPPINGS))} ('auto' is 'ddp').")
    if asked.start not in LIVE_STARTS:
        raise ValueError(f"start={asked.start!r}: live ranks start by {LIVE_STARTS!r}; {entry(asked.start).note}.")
    strategy = "ddp" if asked.strategy == "auto" else asked.strategy
    if asked.start == "fork":
        check_fork()  # refused at once, naming what initialised CUDA
    if asked.start != "auto":
        return Choice(strategy, asked.start, {})
    blocker = fork_blocker()
    if blocker is None:
        return Choice(strategy, "fork", {})
    return Choice(strategy, "template", {}, f"live ranks are forks of the warm template, not of this kernel: {blocker}")


def _slot(asked: Words) -> Choice:
    """A run in a sweep's or a map's slot: ranks from the template, 'fsdp' under torchrun by default
    (it starts its ranks by exec); never a fork of this kernel (slots start from threads)."""
    if asked.strategy not in ("auto", "ddp", "fsdp"):
        raise ValueError(f"strategy={asked.strategy!r}: runs in slots take 'auto' or 'ddp' (DDP when a slot has "
                         "several devices) or 'fsdp'.")
    if asked.start != "auto" and not entry(asked.start).from_threads:
        threaded = StartWords(lambda start: start.from_threads)
        raise ValueError(f"start={asked.start!r} with strategy={asked.strategy!r}: runs in slots start from threads, "
                         f"and {entry(asked.start).note}; give start={threaded!r}.")
    wrap = "ddp" if asked.strategy == "auto" else asked.strategy
    if asked.start == "auto":
        return Choice(wrap, "torchrun" if wrap == "fsdp" else "template", {})
    return Choice(wrap, asked.start, {})


def _launch(asked: Words, plan: DevicePlan) -> Choice:
    """A launch on `plan`.

    start='auto' is torchrun when the launcher's settings are given or the run spans machines,
    else a fork of this kernel when that is safe, else a fork of the warm template. strategy='auto'
    is one device in this kernel when start is 'auto' too, else DDP. Refusals are ValueErrors
    naming both arguments and what is accepted.
    """
    strategy, start, options = asked.strategy, asked.start, asked.options
    both = f"strategy={strategy!r} with {asked.start_said}"
    script = options is not None or plan.num_nodes > 1
    if options is not None and options.get("launcher") == "deepspeed" and strategy != "deepspeed":
        raise ValueError("launcher='deepspeed' runs strategy='deepspeed' (the job calls deepspeed.initialize); "
                         f"strategy={strategy!r} runs under torchrun or accelerate.")
    if plan.num_nodes > 1 and strategy in ("dp", "deepspeed"):
        raise ValueError(f"num_nodes={plan.num_nodes} needs strategy='ddp' or 'fsdp' (torchrun's rendezvous across "
                         f"machines); {strategy!r} runs on this machine only.")
    if strategy == "dp":
        if start != "auto" or options is not None:
            raise ValueError(f"{both}: 'dp' runs in this kernel (DataParallel over the GPUs), no rank processes to "
                             "start; give start='auto', or strategy='ddp' for ranks.")
        if plan.accelerator == "cpu" and plan.nprocs > 1:
            raise ValueError(f"strategy='dp' runs one process; on CPU it cannot use {plan.nprocs} devices. Use "
                             "devices=1, or strategy='ddp' for several CPU ranks.")
        return Choice("dp", IN_KERNEL, {})
    if strategy == "deepspeed":
        if start not in ("auto", "torchrun"):
            raise ValueError(f"{both}: DeepSpeed's own launcher starts the ranks as a script; give start='auto' "
                             "or 'torchrun'.")
        return Choice("deepspeed", "torchrun", deepspeed_options(options))
    if plan.num_nodes > 1 and start not in ("auto", "torchrun"):
        raise ValueError(f"num_nodes={plan.num_nodes} with {asked.start_said}: several machines meet through "
                         "torchrun's rendezvous; give start='torchrun' (or 'auto').")
    if options is not None and start not in ("auto", "torchrun"):
        raise ValueError(f"launcher_options={options!r} with {asked.start_said}: they are torchrun's settings "
                         f"({SCRIPT_SETTINGS}); give start='torchrun' (or 'auto'), or leave them out.")
    if strategy == "auto":
        if plan.world_size == 1 and start == "auto" and not script:
            return Choice("single", IN_KERNEL, {}, f"single on {plan.describe()} (chosen by strategy='auto': one "
                                                   "device runs in this kernel)")
        strategy = "ddp"
    if start != "auto":
        return Choice(strategy, start, options or {})
    if script:
        return Choice(strategy, "torchrun", options or {})
    # The note starts with the run's title ("<strategy> on <devices>"): a display that shows the
    # title says the choice on that one line instead of repeating it (see LineDisplay.start).
    blocker = fork_blocker()
    start = "fork" if blocker is None else "template"
    note = f"{strategy} on {plan.describe()} (started by {start}, chosen by start='auto')"
    # The blocker names its cause (the cell line or import that initialised CUDA).
    return Choice(strategy, start, {}, note if blocker is None else f"{note}, not fork: {blocker}")


def deepspeed_options(given: dict | None) -> dict:
    """strategy='deepspeed' runs as a script under DeepSpeed's own launcher."""
    options = dict(given or {})
    if options.get("launcher") not in (None, "deepspeed"):
        raise ValueError(f"strategy='deepspeed' runs under DeepSpeed's launcher; launcher={options['launcher']!r} "
                         "is for strategy='ddp' or 'fsdp' with start='torchrun'.")
    if options.get("max_restarts"):
        raise ValueError(f"max_restarts={options['max_restarts']!r}: DeepSpeed's launcher does not restart ranks; "
                         "torchrun does (strategy='ddp' or 'fsdp', start='torchrun').")
    return {**options, "launcher": "deepspeed"}
