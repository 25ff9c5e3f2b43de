"""Which modules the notebook reloaded since live ranks last heard: `importlib.reload` gives a
module a new `__spec__` object, so a spec that is not the one seen before means a reload.

Looking costs nothing while nothing changed: a reload also moves its module to the end of
`sys.modules` (importlib's `_exec` pops and re-inserts it), so while the count of modules and
the last one (its name and spec) are as last seen, no module was reloaded or imported, and the
scan of every module (~1 ms with Lightning's 4,000) is skipped. The move is how any reload
shows, whoever calls it (`importlib.reload`, IPython's autoreload), so nothing is hooked."""
from __future__ import annotations

import importlib.util
import os
import sys

from ...common.tracebacks import package_path

# Run on the ranks by an internal exec: names only from builtins, so nothing is asked of the notebook.
RELOAD_SOURCE = "__import__('nbtrain.rank.reloads', fromlist=['reload_modules']).reload_modules({names!r})"


def _spec(module) -> object:
    return getattr(module, "__dict__", {}).get("__spec__")


def _tail() -> tuple:
    """(how many modules, the last one's name, its spec): the same while nothing was imported or reloaded."""
    modules = sys.modules
    try:
        name = next(reversed(modules))
    except (StopIteration, RuntimeError):  # empty, or changed by another thread meanwhile: look again next time
        return (-1, None, None)
    return (len(modules), name, _spec(modules.get(name)))


class ModuleVersions:
    """The kernel's modules as live ranks last saw them."""

    def __init__(self):
        self._tail = _tail()
        self._specs = self._now()

    @staticmethod
    def _now() -> dict:
        return {name: _spec(module) for name, module in list(sys.modules.items())}

    def reloaded(self) -> list[str]:
        """The modules reloaded in the notebook since the last call (or since the ranks started)."""
        tail, seen = _tail(), self._tail
        if tail[0] >= 0 and tail[:2] == seen[:2] and tail[2] is seen[2]:  # specs by identity (== compares fields)
            return []  # nothing moved to the end of sys.modules: nothing was reloaded
        self._tail, now = tail, self._now()
        changed = [name for name, spec in now.items()
                   if spec is not None and name in self._specs and self._specs[name] is not spec]
        self._specs = now
        return changed


# -- a module edited on disk and not reloaded ------------------------------------------------------
# The rule: ranks run the code the notebook has. Forks of the kernel inherit its modules; template,
# spawned, torchrun and cluster ranks import their files. The two agree while the notebook's
# modules match their files; a module edited and not reloaded is said at each launch until it is.

_user: tuple[int, list[str]] = (-1, [])  # (len(sys.modules) when listed, the user's own modules then)
_loaded: dict[str, tuple[object, int]] = {}  # name -> (its spec, its file's mtime when the notebook loaded it)


def _user_modules() -> list[str]:
    global _user
    if _user[0] != len(sys.modules):
        names = []
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__dict__", {}).get("__file__")
            if isinstance(file, str) and file.endswith(".py") and package_path(file) is None:
                names.append(name)
        _user = (len(sys.modules), names)
    return _user[1]


def _mtime_when_loaded(file: str, mtime_ns: int) -> int:
    """The file's mtime as the notebook loaded it, as far as its cached bytecode tells: -1 where
    the source changed after it was compiled (the module may be older than the file)."""
    try:
        with open(importlib.util.cache_from_source(file), "rb") as cached:
            header = cached.read(16)
    except (OSError, ValueError, NotImplementedError):
        return mtime_ns
    if len(header) == 16 and int.from_bytes(header[4:8], "little") == 0:  # a timestamp-checked .pyc
        if int.from_bytes(header[8:12], "little") != (mtime_ns // 1_000_000_000) & 0xFFFFFFFF:
            return -1
    return mtime_ns


def edited_since_loaded() -> list[str]:
    """One line for each of the user's modules whose file changed since the notebook loaded it."""
    lines = []
    for name in _user_modules():
        module = sys.modules.get(name)
        spec = getattr(module, "__dict__", {}).get("__spec__")
        file = getattr(spec, "origin", None)
        if not isinstance(file, str):
            continue
        try:
            mtime = os.stat(file).st_mtime_ns
        except OSError:
            continue
        seen = _loaded.get(name)
        if seen is None or seen[0] is not spec:  # first seen, or reloaded since
            seen = _loaded[name] = (spec, _mtime_when_loaded(file, mtime))
        if mtime != seen[1]:
            lines.append(f"{file} changed on disk since the notebook imported {name}: forked ranks run the notebook's "
                         f"copy, fresh ones (template, spawn, torchrun) the file. importlib.reload({name}) in the "
                         "notebook so every rank runs the same code.")
    return lines
