"""A notebook cell as a job: the cell's code runs unchanged on every rank.

The names a cell reads that earlier cells defined travel with it: modules by name (`import x
as y`), everything else with dill in recurse mode, all in one pickle so that objects sharing
parts (a model and its optimizer) still share them on the rank. Where the ranks are separate
processes the cell runs as `__main__` in a fresh namespace holding those names; in the kernel
(dp, one device) and in forked ranks it runs in the kernel's own namespace, as a cell would.

Nothing here imports IPython: the magics parse options and call `run_cell`.
"""
from __future__ import annotations

import ast
import functools
import linecache
import operator
import os
import re
import sys
import types
from typing import Any, Mapping

CELL_FILENAME = "<nbtrain cell>"
_WRAP = "<nbtrain last value>"  # not an identifier: it cannot clash with the cell's own names
# IPython's own bookkeeping names: never part of what a cell means to ship.
_IPYTHON_NAMES = re.compile(r"_+|_i+|_i?\d+|_[iod]h|In|Out|get_ipython|exit|quit")
IN_PLACE = ("single", "dp", "ddp_fork")  # strategies that run the cell in the kernel's namespace (or its fork)


# -- which names the cell needs -------------------------------------------------------------

class _ModuleLevel(ast.NodeVisitor):
    """Names the cell's top level reads before binding them, in execution order.

    Bodies of functions, lambdas, classes and comprehensions run in scopes of their own and
    are left to `_nested_globals`; only what runs at the top level is visited here.
    """

    def __init__(self):
        self.bound: set[str] = set()
        self.free: list[str] = []

    def _load(self, name: str) -> None:
        if name not in self.bound and name not in self.free:
            self.free.append(name)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)
        else:  # Load, Del: the name must exist already
            self._load(node.id)

    def _visit_all(self, *nodes) -> None:
        for node in nodes:
            if isinstance(node, list):
                self._visit_all(*node)
            elif node is not None:
                self.visit(node)

    # the value is evaluated before the target is bound: `x = x + 1` needs x
    def visit_Assign(self, node) -> None:
        self._visit_all(node.value, node.targets)

    def visit_AnnAssign(self, node) -> None:
        self._visit_all(node.value, node.annotation, node.target)

    def visit_AugAssign(self, node) -> None:
        self._visit_all(node.value)
        if isinstance(node.target, ast.Name):
            self._load(node.target.id)
        self._visit_all(node.target)

    def visit_NamedExpr(self, node) -> None:
        self._visit_all(node.value, node.target)

    def visit_For(self, node) -> None:
        self._visit_all(node.iter, node.target, node.body, node.orelse)

    visit_AsyncFor = visit_For

    def visit_Import(self, node) -> None:
        for alias in node.names:
            self.bound.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node) -> None:
        self.bound.update(alias.asname or alias.name for alias in node.names if alias.name != "*")

    def _visit_arguments(self, args: ast.arguments, annotations: bool) -> None:
        self._visit_all(args.defaults, [d for d in args.kw_defaults if d is not None])
        if annotations:
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            self._visit_all([a.annotation for a in every if a is not None and a.annotation is not None])

    def visit_FunctionDef(self, node) -> None:
        self._visit_all(node.decorator_list)
        self._visit_arguments(node.args, annotations=True)
        self._visit_all(node.returns)
        self.bound.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node) -> None:
        self._visit_arguments(node.args, annotations=False)

    def visit_ClassDef(self, node) -> None:
        self._visit_all(node.decorator_list, node.bases, node.keywords)
        self.bound.add(node.name)

    def _visit_comprehension(self, node) -> None:
        # Its loop variables are its own; the rest reads the cell's names. Walked here rather
        # than left to symtable, which has no scope for comprehensions from Python 3.12 on.
        first, *others = node.generators
        self._visit_all(first.iter)
        saved = self.bound
        self.bound = saved | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        try:
            self._visit_all(first.ifs, [[g.iter, g.ifs] for g in others],
                            [getattr(node, field, None) for field in ("elt", "key", "value")])
        finally:
            self.bound = saved

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _visit_comprehension

    def visit_ExceptHandler(self, node) -> None:
        self._visit_all(node.type)
        if node.name:
            self.bound.add(node.name)
        self._visit_all(node.body)

    def visit_MatchAs(self, node) -> None:
        self._visit_all(node.pattern)
        if node.name:
            self.bound.add(node.name)

    def visit_MatchStar(self, node) -> None:
        if node.name:
            self.bound.add(node.name)

    def visit_MatchMapping(self, node) -> None:
        self._visit_all(node.keys, node.patterns)
        if node.rest:
            self.bound.add(node.rest)


def parse_cell(source: str, filename: str = CELL_FILENAME) -> ast.Module:
    try:
        return ast.parse(source, filename)
    except SyntaxError as exc:
        if (exc.text or "").lstrip()[:1] in ("%", "!"):
            exc.msg += (" (the cell runs as a plain Python script on every rank: IPython's %magics and "
                        "!commands are not available there)")
            exc.args = (exc.msg, *exc.args[1:])
        raise


def _nested_globals(table) -> set[str]:
    """Global names read (or `global`-declared and assigned) inside functions, classes, lambdas."""
    names: set[str] = set()
    for child in table.get_children():
        for symbol in child.get_symbols():
            if symbol.is_global() and (symbol.is_referenced() or symbol.is_declared_global()):
                names.add(symbol.get_name())
        names |= _nested_globals(child)
    return names


def free_names(source: str, filename: str = CELL_FILENAME) -> list[str]:
    """Names the cell reads without binding them first, in order of first use.

    A name used only inside a function the cell defines counts unless the cell's top level
    binds it somewhere (the function then sees the cell's own value when it is called).
    """
    import symtable

    tree = parse_cell(source, filename)
    top = _ModuleLevel()
    top.visit(tree)
    nested = _nested_globals(symtable.symtable(source, filename, "exec")) - top.bound
    return top.free + sorted(nested - set(top.free))


def _shippable(name: str, hidden) -> bool:
    return not (name.startswith("__") or name in hidden or _IPYTHON_NAMES.fullmatch(name))


def _import_name(module: types.ModuleType) -> str | None:
    """The name that `import` finds this very module under, if any."""
    name = getattr(module, "__name__", None)
    if not name or name == "__main__" or sys.modules.get(name) is not module:
        return None
    return name


# -- the job --------------------------------------------------------------------------------

class CellJob:
    """Callable that runs a cell's code and returns the value of its last expression.

    Built in the kernel by `cell_job`; called on every rank (or in the kernel for in-process
    strategies).
    """

    def __init__(self, source: str, imports: list[tuple[str, str]] = (), payload: bytes | None = None,
                 namespace: dict | None = None, sources: dict | None = None, origin: str | None = None):
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
        import dill

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
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


class _LastValue:
    """The cell's last value, on its way back from a rank.

    A rank that did its work should not fail because its last expression (say a Lightning
    Trainer) cannot be pickled: such a value arrives as None, with a note on stderr.
    """

    def __init__(self, value):
        from .context import context

        # Evaluated on every rank: where sharded models are gathered (a collective) under fsdp.
        self.value = context().prepare_return(value)

    def __reduce__(self):
        import dill

        from .transfer import to_cpu

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


def cell_job(source: str, namespace: Mapping[str, Any], strategy: str, hidden=()) -> CellJob:
    """The job for `source`, taking what it needs from the kernel's `namespace`.

    Raises SyntaxError for a cell that is not plain Python, and `UnpicklableError` (naming
    each offending name by its path) before anything starts when a name cannot travel.
    """
    from .launch import ALIASES

    names = [n for n in free_names(source) if n in namespace and _shippable(n, hidden)]
    if ALIASES.get(strategy, strategy) in IN_PLACE:
        return CellJob(source, [], None, namespace)
    imports, values, sources = [], {}, {}
    for name in names:
        value = namespace[name]
        module = _import_name(value) if isinstance(value, types.ModuleType) else None
        if module:
            imports.append((name, module))
        else:
            values[name] = value
        code = getattr(value, "__code__", None)
        if code is not None and code.co_filename in linecache.cache:
            sources[code.co_filename] = linecache.cache[code.co_filename]
    return CellJob(source, imports, _pack_names(values) if values else None, sources=sources)


def _pack_names(values: dict) -> bytes:
    """One pickle for all names (shared parts stay shared); dill in recurse mode, as for `launch`."""
    from .errors import UnpicklableError
    from .pickling import explain_pickling, ship_bytes

    try:
        return ship_bytes(values)
    except Exception as exc:
        # Paths start at the user's own names (`model.loss_fn`), checked one name at a time.
        findings = [f for name, value in values.items() for f in explain_pickling(value, "dill", name)]
        what = f"the names the cell uses from earlier cells ({', '.join(values)})"
        raise UnpicklableError(what, findings, detail=f"{type(exc).__name__}: {exc}") from exc


def run_cell(source: str, namespace: Mapping[str, Any], *, strategy: str = "ddp", devices="auto",
             accelerator: str = "auto", num_nodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
             max_restarts: int = 0, launcher: str = "torchrun", timeout: float | None = None, progress=True,
             hidden=(), rerun_as: str | None = None, cluster=None):
    """Run a cell's code on every rank and return the `Result` (the last expression's value
    on each rank in `values`, rank 0's in `value`). What `%%nbtrain` calls; with `cluster`
    (`nbtrain.Slurm(...)`, `nbtrain.Ray(...)`) the ranks run there, the names shipped."""
    from .launch import launch

    job = cell_job(source, namespace, "ddp" if cluster is not None else strategy, hidden)
    if cluster is not None:
        return launch(job, strategy=strategy, devices=devices, accelerator=accelerator, num_nodes=num_nodes,
                      timeout=timeout, progress=progress, cluster=cluster)
    options = None
    if strategy in ("ddp", "fsdp", "deepspeed"):  # a script under the launcher
        options = {"launcher": launcher, "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint,
                   "max_restarts": max_restarts}
        if rerun_as:
            options["rerun_as"] = rerun_as
    return launch(job, strategy=strategy, devices=devices, accelerator=accelerator, num_nodes=num_nodes,
                  timeout=timeout, progress=progress, launcher_options=options)
