"""Say *which* part of an object cannot be pickled, and what to do about it.

The launcher ships the training function and its arguments to the workers with dill. When
that fails, the pickler names a type ("cannot pickle 'generator' object") but not where it
sits in the user's object graph; `explain_pickling` finds the deepest failing objects and
gives each a readable path from the root, e.g. `train.__globals__['model'].loss_fn`.
"""
from __future__ import annotations

import collections
import copyreg
import importlib
import io
import pickle
import sys
import threading
import types
import warnings
from dataclasses import dataclass, replace

import dill

from .errors import UnpicklableError

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
            explainer.findings.append(Finding(name, _type_name(obj), _one_line(exc), _GENERIC_HINT))
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
                for label, kid in self.failing(_children(obj, self.pickler)):
                    if len(self.findings) >= MAX_FINDINGS:
                        break
                    explained = True  # even when kid was seen: it is reported elsewhere
                    self.explore(kid, path + label, depth + 1)
        except _OutOfBudget:
            pass
        if not explained and len(self.findings) < MAX_FINDINGS:
            tname = _type_name(obj)
            self.findings.append(Finding(path, tname, self.reason(obj), _hint(obj, tname, self.pickler)))


class _OutOfBudget(Exception):
    pass


def _children(obj, pickler: str) -> list[tuple[str, object]]:
    """(path suffix, child) for everything the pickler would serialise as part of `obj`."""
    try:
        return list(_iter_children(obj, pickler))
    except Exception:  # odd objects (raising properties, broken __reduce_ex__) are leaves
        return []


def _iter_children(obj, pickler: str):
    # type(obj), not isinstance: a __class__ property must not fool the walk.
    cls = type(obj)
    if _opaque(obj, cls):
        return
    if issubclass(cls, dict):
        for i, (key, value) in enumerate(obj.items()):
            if not isinstance(key, (str, int, float, bool, bytes, type(None))):
                yield f".<key {i}>", key
            yield f"[{_short_repr(key, i)}]", value
        if issubclass(cls, collections.defaultdict):
            yield ".default_factory", obj.default_factory
    elif issubclass(cls, (list, tuple)):
        yield from ((f"[{i}]", item) for i, item in enumerate(obj))
    elif issubclass(cls, (set, frozenset)):
        yield from ((f".<item {i}>", item) for i, item in enumerate(obj))
    elif pickler == "pickle" and (cls is types.FunctionType or issubclass(cls, type)):
        return  # std pickle stores functions and classes by reference: nothing inside counts
    elif cls is types.FunctionType:
        yield from _function_children(obj)
    elif cls is types.MethodType:
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
        return
    elif _is_torch_module(cls):
        yield from _module_children(obj)
        return
    elif _custom_reduce(cls):
        # What the class chooses to pickle is the truth, whatever its attributes say.
        yield ".__reduce_ex__()", _reduce(obj)
        return
    else:
        found = False
        for label, value in _attributes(obj, cls):
            found = True
            yield label, value
        # A class defined in a notebook or a function travels by value (dill) or fails (pickle).
        yield ".__class__", cls
        if not found and not issubclass(cls, type):
            yield ".__reduce_ex__()", _reduce(obj)
        return
    # Containers and functions may carry instance attributes too (subclasses, fn.attr = ...).
    if cls not in (dict, list, tuple, set, frozenset):
        yield from _attributes(obj, cls)


def _function_children(fn):
    code = fn.__code__
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield f".<closure {var}>", cell.cell_contents
        except ValueError:  # empty cell: the variable is not bound yet
            pass
    # With recurse=True dill ships only the globals the code names, so only those can fail.
    fglobals = fn.__globals__
    for var in sorted(code_global_names(code)):
        if var in fglobals:
            yield f".__globals__[{var!r}]", fglobals[var]
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f".__defaults__[{i}]", default
    for key, default in (fn.__kwdefaults__ or {}).items():
        yield f".__kwdefaults__[{key!r}]", default


def code_global_names(code) -> set[str]:
    """Every global (and attribute) name a code object and the code nested in it may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas, comprehensions, nested defs
            names |= code_global_names(const)
    return names


def _is_torch_module(cls) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to explain a pickling error
    return torch is not None and issubclass(cls, torch.nn.Module)


def _module_children(module):
    # `model.encoder` reads better than `model._modules['encoder']`; the hook dicts
    # (`_forward_hooks` etc.) keep their names since that is where users registered them.
    for key, value in vars(module).items():
        if key in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
            yield from ((f".{k}", v) for k, v in value.items() if v is not None)
        else:
            yield f".{key}", value


def _custom_reduce(cls) -> bool:
    """True when the class decides its own pickled state, so attributes are not the truth."""
    if cls in copyreg.dispatch_table:
        return True
    return any(
        getattr(cls, attr, None) is not getattr(object, attr, None)
        for attr in ("__reduce_ex__", "__reduce__", "__getstate__")
    )


def _reduce(obj):
    rv = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    if not isinstance(rv, tuple):
        return rv
    # Items 3 and 4 are one-shot iterators: materialise them so checking does not drain them.
    return tuple(
        (list(x) if i == 3 else dict(x)) if i in (3, 4) and x is not None else x
        for i, x in enumerate(rv)
    )


def _attributes(obj, cls):
    try:
        attrs = object.__getattribute__(obj, "__dict__")  # skips a class's __getattribute__
    except Exception:
        attrs = {}
    if isinstance(attrs, (dict, types.MappingProxyType)):
        yield from ((f".{k}", v) for k, v in attrs.items())
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            private = slot.startswith("__") and not slot.endswith("__")
            stored = f"_{klass.__name__.lstrip('_')}{slot}" if private else slot  # name mangling
            descriptor = klass.__dict__.get(stored)
            if hasattr(descriptor, "__get__"):
                try:
                    yield f".{slot}", descriptor.__get__(obj, cls)
                except AttributeError:  # unset slot
                    pass


def _opaque(obj, cls) -> bool:
    # Things we have specific advice for are reported whole: the lock inside a Thread or the
    # buffer inside a file object is not what the user should act on.
    return issubclass(cls, _OPAQUE) or _type_name(obj) in _HINTS_BY_TYPE


def _type_name(obj) -> str:
    cls = type(obj)
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", cls.__name__)
    if module in (None, "builtins") or module == qualname:  # `socket`, not `socket.socket`
        return qualname
    return f"{module}.{qualname}"


def _one_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip()
    except Exception:
        text = ""
    return text.splitlines()[0] if text else type(exc).__name__


def _short_repr(key, index: int) -> str:
    try:
        text = repr(key)
    except Exception:
        return f"<key {index}>"
    return text if len(text) <= 60 else text[:57] + "..."


_INSIDE = "create it inside the training function instead of passing it in"
_GENERIC_HINT = (
    "this object cannot be pickled: " + _INSIDE + ", or give its class "
    "__getstate__/__reduce__ that leaves the unpicklable part out"
)
_HINTS_BY_TYPE = {
    "generator": "a generator cannot be sent to another process; create it inside the training function",
    "coroutine": "a coroutine cannot be sent to another process; " + _INSIDE,
    "async_generator": "an async generator cannot be sent to another process; " + _INSIDE,
    "socket": "a socket cannot be sent to another process; "
    "open it inside the training function (one per rank)",
    "sqlite3.Connection": "a database connection cannot be sent to another process; "
    "pass the database path and connect inside the training function",
    "sqlite3.Cursor": "a database cursor cannot be sent to another process; "
    "pass the database path and connect inside the training function",
    "frame": "frames cannot be pickled; keep what you need from them as plain values "
    "(e.g. traceback.format_exc())",
    "traceback": "tracebacks cannot be pickled; keep traceback.format_exc() as a string instead",
    "module": "the standard pickle cannot send modules; "
    "use pickler='dill' or import the module inside the function",
    "threading.Thread": "a thread cannot be sent to another process; start it inside the training function",
}

_OPAQUE = (
    types.ModuleType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType,
    types.FrameType, types.TracebackType, io.IOBase, threading.Thread,
)


def _hint(obj, tname: str, pickler: str) -> str:
    if tname in _HINTS_BY_TYPE:
        return _HINTS_BY_TYPE[tname]
    if isinstance(obj, threading.Thread):
        return _HINTS_BY_TYPE["threading.Thread"]
    if isinstance(obj, io.IOBase):
        return "an open file cannot be sent to another process; " \
            "pass its path and open it inside the training function"
    if tname in ("_thread.lock", "_thread.RLock") or tname.startswith("multiprocessing.synchronize."):
        if pickler == "pickle" and tname.startswith("_thread"):
            return "the standard pickle cannot send locks; use pickler='dill', or " + _INSIDE
        return "a lock cannot be shared with the workers this way; " + _INSIDE
    if tname.startswith("multiprocessing.connection."):
        return "a multiprocessing connection cannot be sent to another process this way; " + _INSIDE
    if pickler == "pickle" and isinstance(obj, (types.FunctionType, types.MethodType, type)):
        return "use pickler='dill' or define it at module level"
    return _GENERIC_HINT


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
