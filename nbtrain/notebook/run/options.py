"""The run options every front end takes, named once, and the check that keeps them apart from the
training function's own keywords.

`launch(fn, *args, **kwargs)` hands every keyword it does not take itself to ``fn``, as Fabric's
``launch`` does. A misspelt option (``stal=30``) would then start every rank and fail in each of
them with ``TypeError: train() got an unexpected keyword argument 'stal'``; it is refused here, in
the notebook, before anything starts, naming the option it resembles.
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

# What launch() takes besides fn and its arguments; submit and Ranks.run take these or a subset.
RUN_OPTIONS = ("strategy", "start", "devices", "accelerator", "num_nodes", "backend", "timeout", "stall",
               "progress", "launcher_options", "cluster", "trackers", "profile", "run_dir", "max_restarts", "wait")


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
