"""What to tell the user about a part that cannot be sent to a rank: advice by type, and the types
reported whole (what is inside them is not what the user should act on)."""
from __future__ import annotations

import io
import threading
import types


def opaque(obj, cls) -> bool:
    # Things we have specific advice for are reported whole: the lock inside a Thread or the
    # buffer inside a file object is not what the user should act on.
    return issubclass(cls, _OPAQUE) or type_name(obj) in _HINTS_BY_TYPE


def type_name(obj) -> str:
    cls = type(obj)
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", cls.__name__)
    if module in (None, "builtins") or module == qualname:  # `socket`, not `socket.socket`
        return qualname
    return f"{module}.{qualname}"


_INSIDE = "create it inside the training function instead of passing it in"
GENERIC_HINT = (
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


def hint(obj, tname: str, pickler: str) -> str:
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
    return GENERIC_HINT
