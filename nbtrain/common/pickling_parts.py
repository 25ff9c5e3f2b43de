"""The parts of an object that a pickler serialises, each with the path that reads it from its parent
(`[0]`, `.__globals__['model']`, `.<closure x>`): what `explain_pickling` walks."""
from __future__ import annotations

import collections
import copyreg
import pickle
import sys
import types

from .pickling_hints import opaque


def children(obj, pickler: str) -> list[tuple[str, object]]:
    """(path suffix, child) for everything the pickler would serialise as part of `obj`."""
    try:
        return list(_iter_children(obj, pickler))
    except Exception:  # odd objects (raising properties, broken __reduce_ex__) are leaves
        return []


def _iter_children(obj, pickler: str):
    # type(obj), not isinstance: a __class__ property must not fool the walk.
    cls = type(obj)
    if opaque(obj, cls):
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


def _short_repr(key, index: int) -> str:
    try:
        text = repr(key)
    except Exception:
        return f"<key {index}>"
    return text if len(text) <= 60 else text[:57] + "..."
