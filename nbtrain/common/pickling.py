"""Say *which* part of an object cannot be pickled, and what to do about it.

The launcher ships the training function and its arguments to the workers with dill. When
that fails, the pickler names a type ("cannot pickle 'generator' object") but not where it
sits in the user's object graph; `explain_pickling` finds the deepest failing objects and
gives each a readable path from the root, e.g. `train.__globals__['model'].loss_fn`.

The walk of an object's parts is `pickling_parts`, the advice given for each kind of part
`pickling_hints`.
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import types
import warnings
from dataclasses import dataclass, replace

import dill

from .errors import UnpicklableError
from .pickling_hints import GENERIC_HINT, hint, type_name
from .pickling_parts import children

PICKLERS = ("dill", "pickle")
MAX_FINDINGS = 20
MAX_DEPTH = 50
# Groups at most this big are checked child by child; bigger ones are bisected.
_SMALL_GROUP = 4
# A hard stop on pickling attempts, so an explanation can never take longer than the failure.
_MAX_CHECKS = 5000
# Distinct failures the traced pass records before it gives up and leaves the rest to checking.
_MAX_TRACED = 200


@dataclass(frozen=True)
class Finding:
    path: str
    type: str
    reason: str
    hint: str


def explain_pickling(obj, pickler: str = "dill", name: str | None = None) -> list[Finding]:
    """Where in an object the pickling fails: the parts that cannot be sent to a rank.

    A launch sends the function and what it uses to ranks that are not forks of the kernel
    (start='template', 'spawn', 'torchrun', clusters); when that fails, the error lists these
    findings. Call it yourself to look before launching.

    Parameters
    ----------
    obj : object
        What to check: a training function, a model, arguments.
    pickler : {'dill', 'pickle'}, default 'dill'
        'dill' is what a launch uses (recurse mode, modules importable by name sent as their
        name), so it finds nothing in what a launch can send; 'pickle' is the standard library's.
    name : str, optional
        The name paths start with; default the function's name, or 'obj'.

    Returns
    -------
    list of Finding
        The deepest parts that fail, each with ``path`` (``train.__globals__['model'].loss_fn``),
        ``type``, ``reason`` and a ``hint``; empty when ``obj`` pickles.

    Raises
    ------
    ValueError
        ``pickler`` is not 'dill' or 'pickle'.
    """
    if pickler not in PICKLERS:
        raise ValueError(f"pickler must be one of {', '.join(map(repr, PICKLERS))}, not {pickler!r}")
    if name is None:
        name = getattr(obj, "__name__", None) if type(obj) is types.FunctionType else None
        name = name if isinstance(name, str) else "obj"
    explainer = _Explainer(pickler)
    try:
        with warnings.catch_warnings():  # dill's PicklingWarnings were shown by the real attempt
            warnings.simplefilter("ignore")
            if explainer.fails(obj):
                explainer.explore(obj, name, 0)
    except Exception as exc:  # the explanation is a courtesy: it must never hide the real error
        if not explainer.findings:
            explainer.findings.append(Finding(name, type_name(obj), _one_line(exc), GENERIC_HINT))
    return explainer.findings


def _save_module_by_name(pickler, module) -> None:
    name = getattr(module, "__name__", None)
    if name and name != "__main__" and sys.modules.get(name) is module:
        pickler.save_reduce(importlib.import_module, (name,), obj=module)
    else:
        dill._dill.save_module(pickler, module)


class ShippingPickler(dill.Pickler):
    """dill in recurse mode, except that a module importable by name travels as its name.

    dill sends a module from outside site-packages (an editable install such as nbtrain
    itself, or the user's own package under development) by value, its whole namespace:
    large, it overwrites the rank's own module, and it fails on anything in that namespace
    that cannot be pickled (after a widget display, nbtrain's own does not).
    """

    dispatch = dill.Pickler.dispatch.copy()
    dispatch[types.ModuleType] = _save_module_by_name


def ship_bytes(obj) -> bytes:
    """`obj` serialised exactly as the launchers send it to ranks."""
    buffer = io.BytesIO()
    ShippingPickler(buffer, recurse=True).dump(obj)
    return buffer.getvalue()


def dumps(obj, what: str, name: str | None = None) -> bytes:
    """Serialise `obj` as the launcher ships it (`ship_bytes`).

    On failure raise `UnpicklableError` naming each offending part; `what` is a phrase such
    as "the function `train` and its arguments".
    """
    try:
        return ship_bytes(obj)
    except Exception as exc:
        raise UnpicklableError(what, explain_pickling(obj, "dill", name), detail=str(exc)) from exc


class _NullFile:
    # Only success matters, so don't spend memory on the bytes.
    def write(self, data):
        return len(data)


class _Explainer:
    def __init__(self, pickler: str):
        self.pickler = pickler
        self.findings: list[Finding] = []
        # Each map holds the object itself so that its id cannot be reused while we run.
        self.cache: dict[int, tuple[object, str | None]] = {}  # id -> (obj, error checked alone)
        self.reasons: dict[int, tuple[object, str]] = {}  # id -> (obj, error) from the traced pass
        self.bad: dict[int, object] | None = None  # everything on a failing path, if known
        self.seen: set[int] = set()  # explored or on the current path: cycles and shared leaves
        self.checks = 0

    def fails(self, obj) -> bool:
        if self.pickler == "dill":
            return self._trace(obj)
        return self.error(obj) is not None

    def _trace(self, obj) -> bool:
        """One dill pass that carries on past failures, noting the stack of each.

        dill pickles in pure Python, so every extra pass over a big graph costs; this pass marks
        every object on a failing path, and the walk then follows those marks instead of
        pickling each subtree again.
        """
        pickler = ShippingPickler(_NullFile(), recurse=True)
        stack, base, self.bad = [], pickler.save, {}

        def save(o, save_persistent_id=True):
            stack.append(o)
            try:
                base(o, save_persistent_id)
            except Exception as exc:
                if len(self.reasons) >= _MAX_TRACED:
                    raise
                # The innermost failure is caught first, so whatever raises here is o's own.
                self.reasons.setdefault(id(o), (o, _one_line(exc)))
                self.bad.update((id(x), x) for x in stack)
            finally:
                stack.pop()

        pickler.save = save  # an instance attribute: dill's code calls self.save / pickler.save
        try:
            pickler.dump(obj)
        except Exception as exc:  # too many failures, or one outside save(): walk by checking
            self.bad = None
            self.cache[id(obj)] = (obj, _one_line(exc))
            return True
        return bool(self.reasons)

    def _dump(self, obj) -> str | None:
        self.checks += 1
        if self.checks > _MAX_CHECKS:
            raise _OutOfBudget
        try:
            if self.pickler == "dill":
                ShippingPickler(_NullFile(), recurse=True).dump(obj)
            else:
                pickle.dump(obj, _NullFile())
        except Exception as exc:  # pickling raises TypeError, PicklingError, RecursionError, ...
            return _one_line(exc)
        return None

    def error(self, obj) -> str | None:
        hit = self.cache.get(id(obj))
        if hit is None:
            hit = self.cache[id(obj)] = (obj, self._dump(obj))
        return hit[1]

    def reason(self, obj) -> str:
        hit = self.reasons.get(id(obj))
        if hit is not None:
            return hit[1]
        try:
            return self.error(obj) or "fails only as part of the enclosing object"
        except _OutOfBudget:
            return "cannot be pickled"

    def failing(self, kids):
        """The (label, child) pairs whose child does not pickle."""
        if self.bad is not None:
            hits = [(label, kid) for label, kid in kids if id(kid) in self.bad]
            if hits:
                return hits
            # Otherwise dill's path went through objects we do not walk (say the temporaries
            # of a __reduce__): find the failing children by checking them.
        return self._bisect(kids, known_bad=True)

    def _bisect(self, kids, known_bad=False):
        # One bad child among n costs O(log n) pickling passes here, not n.
        if len(kids) <= _SMALL_GROUP:
            yield from ((label, kid) for label, kid in kids if self.error(kid) is not None)
        elif known_bad or self._dump(tuple(kid for _, kid in kids)) is not None:
            mid = len(kids) // 2
            yield from self._bisect(kids[:mid])
            yield from self._bisect(kids[mid:])

    def explore(self, obj, path: str, depth: int) -> None:
        if id(obj) in self.seen or len(self.findings) >= MAX_FINDINGS:
            return
        self.seen.add(id(obj))
        explained = False
        try:
            if depth < MAX_DEPTH:
                for label, kid in self.failing(children(obj, self.pickler)):
                    if len(self.findings) >= MAX_FINDINGS:
                        break
                    explained = True  # even when kid was seen: it is reported elsewhere
                    self.explore(kid, path + label, depth + 1)
        except _OutOfBudget:
            pass
        if not explained and len(self.findings) < MAX_FINDINGS:
            tname = type_name(obj)
            self.findings.append(Finding(path, tname, self.reason(obj), hint(obj, tname, self.pickler)))


class _OutOfBudget(Exception):
    pass


def _one_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip()
    except Exception:
        text = ""
    return text.splitlines()[0] if text else type(exc).__name__


# A rank's return value travels the other way: advice about creating things inside the
# training function would be backwards there.
RETURN_ADVICE = ("Return plain data instead: numbers, strings, lists and dicts of them, tensors, a model "
                 "(or its state_dict()), an optimizer's state_dict().")
_RETURN_HINTS = {
    "generator": "return the items themselves, e.g. list(...) of it, not the generator",
    "coroutine": "return the coroutine's result (await it in the rank), not the coroutine",
    "async_generator": "return the items themselves, not the async generator",
    "frame": "return what you need from the frame as plain values",
    "traceback": "return traceback.format_exc() as a string instead",
}
_RETURN_GENERIC = "leave it out of the return value; return plain data (or a state_dict()) instead"


def _return_hint(finding: Finding) -> str:
    if finding.type in _RETURN_HINTS:
        return _RETURN_HINTS[finding.type]
    if "file" in finding.type.lower() or "socket" in finding.type or finding.type.startswith("sqlite3."):
        return "return what you read from it (or its path), not the open object"
    return _RETURN_GENERIC


def explain_return(value, name: str = "value") -> list[Finding]:
    """`explain_pickling` for a rank's return value, with hints for that direction."""
    return [replace(f, hint=_return_hint(f)) for f in explain_pickling(value, "dill", name)]
