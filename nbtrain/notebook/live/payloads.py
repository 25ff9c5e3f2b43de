"""What a call on live ranks sends, checked in the notebook before any rank sees it: code that is
Python, names a rank can take, ranks that exist, a function and its arguments that travel."""
from __future__ import annotations

import keyword
import types

from ...common.errors import UnpicklableError
from ...common.pickling import explain_pickling
from ...common.source import parse_cell

RESERVED = {"ctx": "the rank's Context (nbtrain.context())", "__builtins__": "Python's builtins"}


def syntax_error(source: str, filename: str, mode: str) -> SyntaxError | None:
    """The code's syntax error, if it has one, for the caller to raise: IPython then shows it as for
    `exec()` in a cell (the line, the caret), not from inside a rank or the parser's frames."""
    try:
        if mode == "exec":
            parse_cell(source, filename)  # its hint for %magics and !commands
        compile(source, filename, mode, dont_inherit=True)
    except SyntaxError as exc:
        exc.__traceback__ = None
        exc.debug = _nothing_to_debug  # type: ignore[attr-defined]  # `%debug` (nbtrain's) would otherwise open pdb in nbtrain's frames
        return exc
    return None


def _nothing_to_debug() -> None:
    print("nbtrain: a syntax error has no frames to debug: correct the line shown and run the cell again.")


def check_push_names(objects: dict) -> None:
    """Each pushed object's name becomes a variable on the ranks: an identifier they do not keep."""
    if not objects:
        raise TypeError("push(name=value, ...) needs at least one object to send.")
    for name in objects:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"push({name!r}=...): a pushed object becomes a variable on the ranks, so its "
                             "name must be a Python identifier, e.g. push(lr=0.1).")
        if name in RESERVED:
            raise ValueError(f"push({name}=...): `{name}` is {RESERVED[name]} on every rank and is not replaced; "
                             "push the object under another name.")


def check_targets(ranks, world_size: int) -> list[int] | None:
    """`ranks=` as a list of distinct live ranks (an int is one of them); None: all of them."""
    if ranks is None:
        return None
    ranks = [ranks] if type(ranks) is int else list(ranks)
    bad = [r for r in ranks if type(r) is not int or not 0 <= r < world_size]
    if bad or not ranks:
        raise ValueError(f"ranks={ranks!r}: name one or more of these live ranks, 0 .. {world_size - 1} "
                         "(or None for all of them).")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks={ranks!r}: each rank once; the code would run twice on the same rank.")
    return ranks


def pack_call(fn: types.FunctionType, args: tuple, kwargs: dict, insight) -> bytes:
    """`fn(*args, **kwargs)` as `run` sends it: the function without its globals (a rank runs it
    in its own namespace; the names it lacks come from the notebook as asked), with `insight`'s
    settings (the rank makes its own instrumented function of them)."""
    import dill

    bare = types.FunctionType(fn.__code__, {}, fn.__name__, fn.__defaults__, fn.__closure__)
    bare.__kwdefaults__, bare.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    try:
        return dill.dumps((bare, args, kwargs, insight), recurse=True)
    except Exception as exc:
        findings = [f for part, root in ((bare, fn.__name__), (args, "args"), (kwargs, "kwargs"))
                    for f in explain_pickling(part, "dill", root)]
        raise UnpicklableError(f"the function `{fn.__qualname__}` and its arguments", findings, str(exc)) from exc
