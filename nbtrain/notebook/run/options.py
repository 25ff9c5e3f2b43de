"""The run options every front end takes, named once (`RunOptions`, checked when built), and the
check that keeps them apart from the training function's own keywords.

`launch(fn, *args, **kwargs)` hands every keyword it does not take itself to ``fn``, as Fabric's
``launch`` does. A misspelt option (``stal=30``) would then start every rank and fail in each of
them with ``TypeError: train() got an unexpected keyword argument 'stal'``; it is refused here, in
the notebook, before anything starts, naming the option it resembles.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable
from typing import Any

from .choices import Words, words
from .doctor import check_stall
from .restarts import check_restarts

# What launch() takes besides fn and its arguments; submit and Ranks.run take these or a subset.
RUN_OPTIONS = ("strategy", "start", "devices", "accelerator", "num_nodes", "backend", "timeout", "stall",
               "progress", "launcher_options", "cluster", "trackers", "profile", "run_dir", "max_restarts", "wait")


def check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: give a whole number, 1 or more.")
    return value


def check_timeout(timeout):
    """`timeout` as given, once it is a positive number of seconds (or None: no limit)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):  # so nan too: it is not "no limit"
        raise ValueError(f"timeout={timeout!r}: give a positive number of seconds, or None for no limit.")
    return timeout


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How one run is made: every option checked once, when this is built (a ValueError or
    TypeError saying what is accepted). `launch` builds it from its keywords; `submit` builds it
    and writes `spec()` into run.json, and its supervisor rebuilds it from there (`from_spec`)
    and launches with `keywords()`. The objects a run also takes (cluster, trackers, profile,
    the view) travel beside it: they are not plain data."""
    strategy: str = "auto"
    start: str = "auto"
    devices: Any = "auto"
    accelerator: str = "auto"
    num_nodes: int = 1
    backend: str | None = None
    timeout: float | None = None  # seconds before the run is stopped, every rank's stack shown
    stall: float | bool | None = None
    launcher_options: dict | None = None
    max_restarts: int = 0

    def __post_init__(self):
        check_timeout(self.timeout)
        check_stall(self.stall)
        check_restarts(self.max_restarts)
        if type(self.num_nodes) is not int or self.num_nodes < 1:
            raise ValueError(f"num_nodes={self.num_nodes!r}: give an int >= 1.")
        object.__setattr__(self, "asked", words(self.strategy, self.start, self.launcher_options))

    asked: Words = dataclasses.field(init=False, repr=False, compare=False)  # the request in the new words

    def spec(self) -> dict:
        """The options as run.json keeps them, in the new words (an earlier name was said when given)."""
        return {**self.keywords(), "strategy": self.asked.strategy, "start": self.asked.start,
                "launcher_options": self.asked.options}

    def keywords(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.init}

    @classmethod
    def from_spec(cls, spec: dict) -> RunOptions:
        """Rebuilt from run.json's "launch" (a run written before an option existed has its default)."""
        names = {field.name for field in dataclasses.fields(cls) if field.init}
        return cls(**{key: value for key, value in spec.items() if key in names})


def refuse_foreign_keywords(fn: Callable, args: tuple, kwargs: dict, caller: str,
                            options: tuple[str, ...] = RUN_OPTIONS) -> None:
    """A TypeError, before anything starts, when ``fn(*args, **kwargs)`` cannot be called as given:
    a keyword ``fn`` does not take (named with the option it resembles, if any), or arguments that
    do not fit its parameters. Nothing is said for a function whose signature cannot be read."""
    try:
        # Not through __wrapped__: a decorator's own (*args, **kwargs) may take what the wrapped one does not.
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or a C callable: its own error will say it
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    name = getattr(fn, "__name__", type(fn).__name__)
    for key in kwargs:
        if takes_any or key in signature.parameters:
            continue
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
        hint = (f" Did you mean {caller}'s option {close[0]}=?" if close
                else f" {caller}'s own options are: {', '.join(options)}.")
        raise TypeError(f"{caller}({name}, ..., {key}=...): {name}() takes no keyword {key!r}, and {caller} "
                        f"passes keywords it does not take itself on to {name}.{hint} Nothing was started.")
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{caller}({name}, ...): the arguments do not fit {name}{signature}: {error}. "
                        "Nothing was started.") from None
