"""The one table of `start=` words: each word, the placement that starts its ranks, and where it may be used.

Every front end resolves its request with `choices.choose` (launch, live ranks, a slot: it reads
`from_threads` and `live` here) and makes the start's launcher with `launcher_for`; the words the
magics and error messages accept are `STARTS` and `LIVE_STARTS`, read from the table when asked.
Adding a placement is a `ProcessLauncher` subclass and one `register(Start(...))`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...placements.base import Job, ProcessLauncher
from ...placements.processes import ForkLauncher, SpawnLauncher
from ...placements.script import ScriptLauncher
from ...placements.template import start_ranks_cleanly
from .inprocess import InProcessLauncher

IN_KERNEL = "kernel"  # the resolved start of strategies 'single' and 'dp': no rank processes


@dataclass(frozen=True)
class Start:
    """A `start=` word and what it means."""
    word: str
    launcher: Callable[[object, Job | None], ProcessLauncher]  # (display, job) -> the launcher; the job is
    # given for a launch (a start that ships it checks it pickles before anything starts)
    from_threads: bool = True  # may start from a thread other than the kernel's main one (a sweep's slot)
    live: bool = True  # can host live ranks, which wait for the next command; a script runs to its end
    note: str = ""  # for the refusals: why the start is not accepted where `from_threads`/`live` is false


_TABLE: dict[str, Start] = {}


def register(start: Start) -> None:
    """Make `start.word` a start every front end accepts (launch, the magics, live ranks, sweeps, map)."""
    if not start.word.isidentifier() or start.word in ("auto", IN_KERNEL):
        raise ValueError(f"start word {start.word!r}: give a new name (not 'auto' or {IN_KERNEL!r}).")
    _TABLE[start.word] = start


def unregister(word: str) -> None:
    _TABLE.pop(word, None)


register(Start("fork", lambda display, job: ForkLauncher(), from_threads=False,
               note="a fork of this kernel from a thread can hang on a lock another thread holds"))
register(Start("template", start_ranks_cleanly))
register(Start("spawn", lambda display, job: SpawnLauncher()))
register(Start("torchrun", lambda display, job: ScriptLauncher(), live=False,
               note="torchrun runs a script to its end, where live ranks wait for the next command"))


class StartWords:
    """'auto' and the table's words where `keep` holds, read when asked: argparse's `choices=`
    and the refusals list a placement registered after import too."""

    def __init__(self, keep: Callable[[Start], bool] = lambda start: True):
        self._keep = keep

    def __iter__(self) -> Iterator[str]:
        yield "auto"
        yield from (word for word, start in _TABLE.items() if self._keep(start))

    def __contains__(self, word) -> bool:
        return word in list(self)

    def __repr__(self) -> str:
        return ", ".join(map(repr, self))


STARTS = StartWords()
LIVE_STARTS = StartWords(lambda start: start.live)


def entry(word: str) -> Start:
    return _TABLE[word]


def launcher_for(word: str, display, job: Job | None = None):
    """The launcher for a resolved start: in the kernel, or the table's placement."""
    if word == IN_KERNEL:
        return InProcessLauncher()
    return _TABLE[word].launcher(display, job)
