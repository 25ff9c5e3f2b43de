"""A notebook cell as a callable job: on every rank (or in the kernel, for in-place strategies)
it runs the cell's code in a namespace of its own and returns the value of its last expression.
Built in the kernel by `nbtrain.notebook.ipython.cell.cell_job`."""
from __future__ import annotations

import ast
import functools
import linecache
import operator
import os
import socket
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import dill

from ..common.source import CELL_FILENAME, parse_cell
from ..common.transfer import to_cpu
from .context import context

_WRAP = "<nbtrain last value>"  # not an identifier: it cannot clash with the cell's own names


class CellJob:
    """Callable that runs a cell's code and returns the value of its last expression.

    Built in the kernel by `cell_job`; called on every rank (or in the kernel for in-process
    strategies).
    """

    def __init__(self, source: str, imports: Sequence[tuple[str, str]] = (), payload: bytes | None = None,
                 namespace: Mapping[str, Any] | None = None, sources: dict | None = None, origin: str | None = None):
        self.source = source
        self.imports = list(imports)  # (name in the cell, module to import)
        self.payload = payload  # dill of {name: value} for the other names
        self.namespace = namespace  # the kernel's own namespace, for strategies that run in place
        self.sources = sources or {}  # linecache entries of earlier cells' functions
        self.origin = origin or _here()  # the kernel: there the value needs no wrapping
        self.__qualname__ = self.__name__ = "cell"

    def __reduce__(self):
        # The kernel's namespace never travels: what a spawned rank needs is in the payload.
        return (CellJob, (self.source, self.imports, self.payload, None, self.sources, self.origin))

    def _fresh_main(self, install: bool) -> dict:
        """A new `__main__` module holding the shipped names. Installed as `sys.modules["__main__"]`
        in a rank, so pickling by reference of what the cell defines (DataLoader workers,
        Lightning's hparams) finds it; never in the kernel."""
        main = types.ModuleType("__main__")
        main.__dict__.update(__file__=CELL_FILENAME, __builtins__=__builtins__)
        if install:
            sys.modules["__main__"] = main
        ns = main.__dict__
        for name, module in self.imports:
            __import__(module)
            ns[name] = sys.modules[module]
        if self.payload is not None:
            ns.update(dill.loads(self.payload))
        _rebind_functions(ns)
        return ns

    def _compile(self, wrap: bool):
        """The cell as two code objects: its body, and its last expression (None if it has none)."""
        tree = parse_cell(self.source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        body = compile(tree, CELL_FILENAME, "exec")
        if last is None:
            return body, None
        assert isinstance(last, ast.Expr)  # popped only when it is one
        value = last.value
        if wrap:
            value = ast.copy_location(ast.Call(ast.Name(_WRAP, ast.Load()), [value], []), value)
            ast.fix_missing_locations(value)
        return body, compile(ast.Expression(value), CELL_FILENAME, "eval")

    @property
    def __call__(self):
        """`job()` runs the cell and returns its last value.

        A property, so the setup runs here and what is then called is the cell's own code with
        no frame of ours around it: a failing cell's traceback starts at the cell's line, as a
        launched function's does.
        """
        lines = self.source.splitlines(keepends=True)
        linecache.cache.update(self.sources)
        linecache.cache[CELL_FILENAME] = (len(self.source), None, lines, CELL_FILENAME)
        in_kernel = _here() == self.origin
        ns = self.namespace if self.namespace is not None else self._fresh_main(install=not in_kernel)
        if not in_kernel:
            ns[_WRAP] = _LastValue
        body, value = self._compile(wrap=not in_kernel)
        # Module code called as a function runs with the namespace as globals and locals, as exec does.
        run_body = types.FunctionType(body, ns, "<cell>")
        if value is None:
            return run_body
        # body(), then value(): composed of C callables only ({}.get(None, v) is v), so no frame
        # of ours sits between the caller and the cell.
        steps = map(operator.methodcaller("__call__"), (run_body, types.FunctionType(value, ns, "<cell>")))
        return functools.partial(functools.reduce, {}.get, steps)


def _here() -> str:
    """This process, told apart from processes on other machines (a pid alone is not)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class _LastValue:
    """The cell's last value, on its way back from a rank.

    A rank that did its work should not fail because its last expression (say a Lightning
    Trainer) cannot be pickled: such a value arrives as None, with a note on stderr.
    """

    def __init__(self, value):
        # Evaluated on every rank: where sharded models are gathered (a collective) under fsdp.
        self.value = context().prepare_return(value)

    def __reduce__(self):

        try:
            return (dill.loads, (dill.dumps(to_cpu(self.value), recurse=True),))
        except Exception as exc:
            print(f"nbtrain: the cell's last value ({type(self.value).__name__}) cannot be sent back "
                  f"({type(exc).__name__}: {exc}); Result.value is None.", file=sys.stderr, flush=True)
            return (type(None), ())


def _rebind_functions(ns: dict) -> None:
    """Functions from earlier cells see this cell's names, as in the kernel.

    dill gives each shipped function a private copy of the globals it used; in the kernel
    they share one namespace, so a function defined earlier sees what this cell assigns.
    """
    changed = True
    while changed:  # merging a function's globals may bring in more functions
        changed = False
        for name, value in list(ns.items()):
            if (type(value) is types.FunctionType and value.__globals__ is not ns
                    and value.__globals__.get("__name__", "__main__") == "__main__"):  # a notebook's, not a library's
                for key, item in value.__globals__.items():
                    ns.setdefault(key, item)
                again = types.FunctionType(value.__code__, ns, value.__name__, value.__defaults__, value.__closure__)
                again.__kwdefaults__, again.__qualname__ = value.__kwdefaults__, value.__qualname__
                again.__dict__.update(value.__dict__)
                ns[name] = again
                changed = True
