"""Which names a cell's source reads: what the kernel ships with a cell, and what a live rank
fetches from the notebook when a cell reads a name it lacks. Pure `ast`/`symtable` work that both
sides do on the same source."""
from __future__ import annotations

import ast
import re
import symtable

CELL_FILENAME = "<nbtrain cell>"
# IPython's own bookkeeping names: never part of what a cell means to ship.
_IPYTHON_NAMES = re.compile(r"_+|_i+|_i?\d+|_[iod]h|In|Out|get_ipython|exit|quit")


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
    tree = parse_cell(source, filename)
    top = _ModuleLevel()
    top.visit(tree)
    nested = _nested_globals(symtable.symtable(source, filename, "exec")) - top.bound
    return top.free + sorted(nested - set(top.free))


def shippable(name: str, hidden=()) -> bool:
    """Whether a notebook name may travel to the ranks (not dunder, IPython's own, or hidden)."""
    return not (name.startswith("__") or name in hidden or _IPYTHON_NAMES.fullmatch(name))
