"""`export()`: a training function and the notebook code it needs, written as a directory that
runs with no notebook: a readable `job.py`, `run.sh` (torchrun on this machine, under a
submitted run's supervisor: `exported_job.py`), `sbatch.sh` (SLURM) and `requirements.txt`.

The function, and the notebook's functions and classes it reads, are written as their source
wherever the kernel still has it (IPython keeps each cell's); modules it reads become imports;
anything else (data, objects without source) is pickled next to the script, as `launch` ships it.
A steered run's changes (`changes=`) go with it as changes.json, which the job makes again at
their steps (`rank/steer.Replay`), and job.py lists them for a reader.
"""
from __future__ import annotations

import ast
import inspect
import json
import linecache
import os
import shlex
import stat
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import dill

from ...common import protocol
from ...common.devices import plan_devices
from ...common.pickling import ship_bytes
from ...common.pickling_parts import code_global_names
from ...common.runlog import make_private_dir, write_whole
from ...rank.cell import CellJob
from ...rank.exported import ARGUMENTS
from ...rank.steer import CHANGES, REPLAYED

NAMES = "names.pkl"  # what the code reads that has no source: pickled
EXPORT = "export.json"  # for run.sh (`exported_job.py`): the function's name (None: a cell) and launch's settings
ALWAYS = ("torch", "nbtrain", "dill")  # in requirements.txt whatever the code imports


def export(fn, *args, to, devices="auto", accelerator: str = "auto", num_nodes: int = 1, changes=(),
           **kwargs) -> Path:
    """Write ``fn(*args, **kwargs)`` as a job directory that runs with no notebook.

    ``bash run.sh`` there runs it under torchrun on this machine (as many ranks as ``devices``
    plans), watched as a submitted run is, so ``nbtrain.attach(to / "run")`` follows it;
    ``sbatch sbatch.sh`` runs it on SLURM. ``job.py`` holds the function's source and what it
    uses from the notebook. Rank 0's return value is printed and written to ``run/value.pkl``.
    ``%nbtrain export PATH`` does the same for the last ``%%nbtrain`` cell.

    Parameters
    ----------
    fn : function
        A function defined with ``def`` at a notebook's (or module's) top level.
    *args
        Positional arguments for ``fn`` (pickled into the job).
    to : str or Path
        A new or empty directory for the job.
    devices : int or str, default 'auto'
        As for `launch`: ranks per node.
    accelerator : {'auto', 'gpu', 'cpu'}, default 'auto'
        As for `launch`.
    num_nodes : int, default 1
        Nodes, for ``sbatch.sh``.
    changes : list of Change, default ()
        A steered run's changes (``run.changes``, ``Result.changes``): the job makes its sets
        and its stop again at their steps (``changes.json``), and ``job.py`` lists them all.
    **kwargs
        Keyword arguments for ``fn``.

    Returns
    -------
    Path
        The job's directory.

    Raises
    ------
    TypeError
        ``fn`` is not a function defined with ``def``, ``to`` is not a path, or ``changes`` are
        not a steered run's.
    ValueError
        What job.py cannot define (a lambda, a closure, a decorated function, source that cannot be
        read) or sbatch.sh cannot name (a path with whitespace or quotes); nothing is written.
    FileExistsError
        ``to`` exists and is not empty.
    NbtrainError
        Something the function uses cannot be pickled (also a TypeError); the message names each path.
    """
    if not isinstance(fn, CellJob) and (not isinstance(fn, types.FunctionType)):
        raise TypeError(f"export(fn=...) needs a Python function defined with def, got {type(fn).__name__}.")
    where = _check_to(to)
    changes = _check_changes(changes, fn)
    plan = plan_devices(devices, accelerator, None, num_nodes)
    if isinstance(fn, CellJob):  # a %%nbtrain cell: its source as it is, its names as they travel
        imports, script = {n: _import_line(n, m) for n, m in fn.imports}, _cell_script(fn, plan)
        pickled = fn.payload
    else:
        imports, sources, names = _gather(fn)
        script = _script(fn, imports, sources, bool(names), plan, changes)
        pickled = ship_bytes(names) if names else None
    make_private_dir(where, "to")
    if pickled:
        write_whole(where / NAMES, pickled)
    write_whole(where / ARGUMENTS, ship_bytes((args, kwargs)))
    if changes:
        write_whole(where / CHANGES, json.dumps([c._asdict() for c in changes], indent=1, default=repr).encode())
    launch = {"strategy": "ddp", "start": "torchrun", "devices": plan.nprocs, "accelerator": plan.accelerator,
              "num_nodes": 1,
              "backend": None, "timeout": None, "launcher_options": None}  # run.sh: torchrun on this machine
    write_whole(where / EXPORT, json.dumps({"function": None if isinstance(fn, CellJob) else fn.__name__,
                                            "launch": launch}, indent=1).encode())
    _write(where / "job.py", script)
    nproc = plan.nprocs
    # The kernel's import path: modules the code imports from its directory (or a sys.path entry) are found.
    path = shlex.quote(os.pathsep.join(p or os.getcwd() for p in sys.path))
    _write(where / "run.sh", RUN_SH.format(python=shlex.quote(sys.executable), path=path), executable=True)
    _write(where / "sbatch.sh",
           SBATCH_SH.format(name=getattr(fn, "__name__", "cell"), nodes=plan.num_nodes, nproc=nproc,
                                                 path=path, python=shlex.quote(sys.executable), where=where,
                                                 gpus=f"#SBATCH --gpus-per-node={nproc}\n" if plan.accelerator == "gpu"
                                                 else "", accelerator=plan.accelerator), executable=True)
    _write(where / "requirements.txt", _requirements(imports))
    (where / "run").mkdir(mode=0o700)  # sbatch writes the job's output there before the script starts
    return where


def _check_to(to) -> Path:
    """`to` as an absolute path that run.sh and sbatch.sh can name: sbatch reads its #SBATCH lines
    itself (no shell quoting there), so what it would split or cut is refused, not written."""
    if not isinstance(to, (str, os.PathLike)) or not os.fspath(to):
        raise TypeError(f"export(to={to!r}): give the path of a new or empty directory (str or Path).")
    where = Path(to).absolute()
    odd = sorted({c for c in str(where) if not c.isprintable() or c.isspace() or c in "\"'\\#%"})
    if odd:
        raise ValueError(f"export(to={str(to)!r}): sbatch.sh names this directory in an #SBATCH line, which cannot "
                         f"hold {', '.join(map(repr, odd))}; give a path without whitespace, control characters, "
                         "quotes, backslashes, '#' or '%'.")
    return where


def _check_changes(changes, fn) -> list:
    if isinstance(changes, (str, bytes)) or not all(isinstance(c, protocol.Change) for c in changes):
        raise TypeError(f"export(changes={changes!r}): give a steered run's changes (run.changes, or "
                        "Result.changes): a list of Change.")
    if changes and isinstance(fn, CellJob):
        raise ValueError("export(changes=...) of a %%nbtrain cell: a cell's job replays no changes; export the "
                         "training function instead.")
    return list(changes)


def _check_function(fn, source: str | None) -> None:
    """Refuse what job.py cannot define as `def NAME(...)` at its top level and call by that name."""
    name = fn.__name__
    if name == "<lambda>":
        raise ValueError("export(fn=<lambda>): a lambda has no name job.py could call it by; define the function "
                         "with def at the top of a cell or a file.")
    if fn.__code__.co_freevars:
        raise ValueError(f"export(fn={name}): it reads {', '.join(fn.__code__.co_freevars)} from the function it was "
                         "defined in (a closure), which job.py cannot hold; define it at the top of a cell or a file.")
    if source is None:
        return
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef) or body[0].name != name or body[0].decorator_list:
        raise ValueError(f"export(fn={name}): its source is not one plain `def {name}(...)` (a decorated function, "
                         "or one made by other code), which job.py needs; export the undecorated function.")


def _gather(fn):
    """(imports, sources, pickled names) for the notebook code `fn` reads, followed through the
    notebook's own functions and classes."""
    imports: dict[str, str] = {}
    sources: dict[str, str] = {}  # name -> source, in the order found (fn last)
    pickled: dict[str, object] = {}
    seen: set[str] = set()

    def visit(obj) -> None:
        namespace = getattr(obj, "__globals__", None)
        if namespace is None:  # a class: its methods' globals
            functions = [v for v in vars(obj).values() if isinstance(v, types.FunctionType)]
            for function in functions:
                visit(function)
            return
        for name in sorted(code_global_names(obj.__code__)):
            if name in seen or name not in namespace:
                continue
            seen.add(name)
            value = namespace[name]
            module = getattr(value, "__module__", None)
            if isinstance(value, types.ModuleType):
                imports[name] = _import_line(name, value.__name__)
            elif module not in (None, "__main__") and getattr(value, "__qualname__", "").isidentifier() \
                    and getattr(sys.modules.get(module), value.__qualname__, None) is value:
                qualname = value.__qualname__  # type: ignore[union-attr]  # checked just above
                imports[name] = f"from {module} import {qualname}" + (f" as {name}" if name != qualname else "")
            elif isinstance(value, (types.FunctionType, type)) and (source := _source(value)) \
                    and value.__name__ == name:
                visit(value)
                sources[name] = source
            else:
                pickled[name] = value

    own = _source(fn)
    _check_function(fn, own)
    visit(fn)
    if own is None:
        raise ValueError(f"export: the source of {fn.__name__!r} cannot be read (a function defined with exec, or "
                         "in a cell the kernel no longer has); define it in a cell or a file, then export again.")
    sources[fn.__name__] = own
    return imports, sources, pickled


def _import_line(name: str, module: str) -> str:
    if name == module:
        return f"import {module}"
    if "." in module and module.rsplit(".", 1)[1] == name:
        return f"from {module.rsplit('.', 1)[0]} import {name}"
    return f"import {module} as {name}"


def _source(obj) -> str | None:
    code = getattr(obj, "__code__", None)
    if code is not None and code.co_filename not in linecache.cache and not os.path.exists(code.co_filename):
        return None
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def _script(fn, imports: dict, sources: dict, has_names: bool, plan, changes: list) -> str:
    lines = [f'"""{fn.__name__}, exported from a notebook by nbtrain: `bash run.sh` runs it with torchrun on '
             f'{plan.describe()},', '`sbatch sbatch.sh` on SLURM. Rank 0 prints its return value and writes it to '
             'run/value.pkl."""', "import os", "", *sorted(set(imports.values()))]
    if changes:
        lines += ["", f"# The run was steered while it trained ({CHANGES}); run.sh and sbatch.sh make its "
                  f"{' and '.join(REPLAYED)} again at the same steps:"]
        lines += [f"#   step {c.step}: {c.detail}{'' if c.what in REPLAYED else ' (not made again)'}" for c in changes]
    if has_names:
        lines += ["", "import dill", "from nbtrain.common.private import read_own", "",
                  f"# What the code reads that has no source in the notebook ({NAMES}), read only if it is yours.",
                  f"globals().update(dill.loads(read_own(os.path.join(os.path.dirname(os.path.abspath(__file__)), "
                  f"{NAMES!r}))))"]
    for source in sources.values():
        lines += ["", "", source.rstrip()]
    lines += ["", "", 'if __name__ == "__main__":', "    from nbtrain.rank.exported import main", "",
              f"    main({fn.__name__}, os.path.dirname(os.path.abspath(__file__)))", ""]
    return "\n".join(lines)


def _cell_script(job: CellJob, plan) -> str:
    source = job.source.rstrip()
    # As written in the cell, where a raw string can hold it (its first line is blank: line numbers are the cell's + 1).
    quoted = f'r"""\n{source}\n"""' if '"""' not in source and not source.endswith("\\") else repr(source)
    return "\n".join([
        f'"""A notebook cell, exported by nbtrain: `bash run.sh` runs it with torchrun on {plan.describe()},',
        "`sbatch sbatch.sh` on SLURM. Rank 0 prints the value of its last expression and writes it to run/value.pkl.",
        f"The names it reads from earlier cells are imports, or pickled in {NAMES}.\"\"\"",
        "import os", "", "from nbtrain.common.private import read_own", "from nbtrain.rank.cell import CellJob",
        "from nbtrain.rank.exported import main", "",
        f"CELL = {quoted}", f"IMPORTS = {job.imports!r}", "", 'if __name__ == "__main__":',
        "    here = os.path.dirname(os.path.abspath(__file__))",
        f"    names = os.path.join(here, {NAMES!r})",
        "    payload = read_own(names) if os.path.exists(names) else None",
        "    main(CellJob(CELL, IMPORTS, payload), here)", ""])


RUN_SH = """#!/bin/bash
# Runs job.py with torchrun on this machine, watched as nbtrain.submit's runs are: run/ is its run
# directory (nbtrain.attach("run") follows it from a notebook); rank 0's return value is printed
# and written to run/value.pkl.
set -euo pipefail
cd "$(dirname "$0")"
export NBTRAIN_RUN_DIR="${{NBTRAIN_RUN_DIR:-$PWD/run}}"
export PYTHONPATH={path}"${{PYTHONPATH:+:$PYTHONPATH}}"
exec {python} -P -c 'import sys; from nbtrain.notebook.detached.exported_job import main
sys.exit(main(sys.argv[1]))' "$PWD"
"""

SBATCH_SH = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --chdir={where}
#SBATCH --output=run/slurm-%j.out
# One torchrun per node (srun), meeting at the first node's address. `sbatch sbatch.sh` from anywhere.
set -euo pipefail
export NBTRAIN_RUN_DIR="$PWD/run" NBTRAIN_ACCELERATOR={accelerator}
export PYTHONPATH={path}"${{PYTHONPATH:+:$PYTHONPATH}}"
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))  # one per job: two jobs on one node do not collide
srun {python} -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc-per-node {nproc} \\
    --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \\
    --log-dir "run/torchrun-$SLURM_NODEID" job.py
"""


def _requirements(imports: dict) -> str:
    names = {*ALWAYS, *(line.split()[1].split(".")[0] for line in imports.values())}
    found = metadata.packages_distributions()
    pins = sorted({f"{d}=={metadata.version(d)}" for n in names for d in found.get(n, ())})
    return f"# Python {sys.version.split()[0]}; the versions this notebook ran with\n" + "\n".join(pins) + "\n"


def _write(path: Path, text: str, executable: bool = False) -> None:
    write_whole(path, text.encode())
    if executable:
        os.chmod(path, stat.S_IRWXU)


def load_job(payload: bytes):
    """A submitted run's (fn, args, kwargs), with the cell sources it travelled with back in
    linecache (so `export` finds them) and nothing added to this kernel's namespace."""
    fn, args, kwargs, sources = dill.loads(payload)
    for filename, entry in sources.items():
        linecache.cache.setdefault(filename, entry)
    return fn, args, kwargs
