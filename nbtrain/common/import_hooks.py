"""Run a function on a module as soon as its import finishes: nbtrain changes some libraries
(torch.cuda's init hook, IPython's publisher, tqdm's notebook bar, torch's elastic launcher) only
when the user's code imports them, never by importing them itself.

One meta path finder, first in `sys.meta_path`, finds nothing itself: for a module someone waits
for, it asks the other finders for the spec and wraps that spec's loader, so the waiting
functions run right after the module's code. It leaves `sys.meta_path` when nothing waits.
Modules loaded by a loader class (built-in and frozen modules) are not followed.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.waiting: dict[str, list[Callable]] = {}
        self.lock = threading.Lock()

    def find_spec(self, name, path=None, target=None):
        if name not in self.waiting:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):  # nothing to wrap
            return spec
        exec_module = loader.exec_module

        def exec_then_run_waiting(module):
            exec_module(module)  # an import that fails leaves the functions waiting for the next try
            vars(loader).pop("exec_module", None)  # the loader as it was (a reload runs the module alone)
            with self.lock:
                waiting = self.waiting.pop(name, [])
                if not self.waiting and self in sys.meta_path:
                    sys.meta_path.remove(self)
            for then in waiting:
                _safely(then, module)

        try:
            loader.exec_module = exec_then_run_waiting
        except AttributeError:  # a loader without attributes of its own
            pass
        return spec


_finder = _AfterImport()


def when_imported(name: str, then: Callable) -> None:
    """`then(module)` now if module `name` is imported, else as soon as its import finishes.

    An exception from `then` is logged, never raised: the user's import goes on whatever happens.
    A function already waiting for `name` is not added again.
    """
    module = sys.modules.get(name)
    if module is not None:
        _safely(then, module)
        return
    with _finder.lock:
        waiting = _finder.waiting.setdefault(name, [])
        if then not in waiting:
            waiting.append(then)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _safely(then: Callable, module) -> None:
    try:
        then(module)
    except Exception as exc:
        log.warning("nbtrain: could not prepare %s: %s", module.__name__, exc)
