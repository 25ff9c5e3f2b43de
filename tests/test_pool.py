"""The pool keeps its state to itself: the supervisor asks it only through the interface it
declares (`watched.Watched`), which the pool offers whole, and the pool has no public
attribute anyone can change. (The pool at work: test_launch.py, test_ranks.py.)"""
import ast
import inspect

from nbtrain.notebook.run import pool, supervisor


def _asked_of_the_pool(tree) -> set[str]:
    """Every `self.pool.X` and `pool.X` (the local name it is given) in the supervisor's code."""
    asked = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "pool") or (isinstance(owner, ast.Name)
                                                                          and owner.id == "pool"):
            asked.add(node.attr)
    return asked


def test_the_supervisor_asks_the_pool_only_what_its_interface_declares():
    declared = {name for name, value in vars(supervisor.Watched).items()
                if isinstance(value, property) or callable(value) and not name.startswith("_")}
    asked = _asked_of_the_pool(ast.parse(inspect.getsource(supervisor.Supervisor)))
    assert asked and asked <= declared, sorted(asked - declared)
    missing = [name for name in declared if not hasattr(pool.Pool, name)]
    assert not missing, f"the pool does not offer {missing}"


def test_the_pools_state_is_private():
    init = next(node for node in ast.walk(ast.parse(inspect.getsource(pool.Pool)))
                if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assigned = {target.attr for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for target in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    assert assigned and all(name.startswith("_") for name in assigned), sorted(n for n in assigned if n[0] != "_")
    public = [name for name, value in vars(pool.Pool).items() if isinstance(value, property) and value.fset is not None]
    assert not public, f"settable from outside: {public}"
