"""`bash run.sh` of an exported job (`export.py`): the job run by a submitted run's supervisor
(`supervise.py`) in this process, so its `run/` directory is a run directory as `submit` writes
it (status, events, result or error) and `nbtrain.attach(run_dir)` follows it. The ranks run
under torchrun (`launch`'s start='torchrun'); the terminal shows the run as `launch` prints it.
"""
from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

from ...common import runlog, session
from ...common.pickling import ship_bytes
from ...common.private import private_dir, read_own, read_own_json
from ...display import make_display
from ...rank.cell import CellJob
from ...rank.exported import ARGUMENTS, VALUE
from ...rank.steer import replaying
from . import supervise
from .export import EXPORT, NAMES

# What a run of the job writes in its run directory; an earlier run's are removed first (the
# code's own files there, its checkpoints, are kept: it resumes from them).
OWN = (runlog.SPEC, runlog.STATUS, runlog.EVENTS, runlog.RESULT, runlog.ERROR, runlog.SUPERVISOR, VALUE)


def main(here: str | Path) -> int:
    here = Path(here).absolute()
    plan = read_own_json(here / EXPORT)  # the job's files are ours, as the run's: nothing else is read
    plan["launch"].setdefault("start", "torchrun")  # exported before start= existed, when strategy 'ddp' said so
    run_dir = private_dir(Path(os.environ.get("NBTRAIN_RUN_DIR") or here / "run").absolute())
    for old in [*(run_dir / name for name in (*OWN, runlog.SUMMARY)), *run_dir.glob(runlog.rank_events("*"))]:
        old.unlink(missing_ok=True)
    me = session.identity(os.getpid())  # the supervisor is this process: for Run.cancel, and "alive"
    runlog.write_json(run_dir / runlog.SUPERVISOR, me)
    runlog.write_spec(run_dir / runlog.SPEC, {"function": plan["function"] or "cell", "started": time.time(),
                                              "max_restarts": 0, "launch": plan["launch"]})
    runlog.write_json(run_dir / runlog.STATUS, {"status": "queued", "restarts": [], "max_restarts": 0,
                                                "submitter": me})
    code = supervise.main(str(run_dir), lambda: _load(here, plan["function"]), echo=make_display(True))
    if code == 0:
        value = runlog.read_pickle(run_dir / runlog.RESULT).value
        runlog.write_whole(run_dir / VALUE, ship_bytes(value))
        print(f"rank 0 returned: {value!r}", flush=True)
    return code


def _load(here: Path, name: str | None) -> tuple:
    """(fn, args, kwargs, objects) from job.py, run as a module of no importable name: its
    functions travel to the ranks by value, as a notebook's do."""
    script = runpy.run_path(str(here / "job.py"), run_name="__nbtrain_job__")
    if name is None:  # a cell: its source, the imports it needs, the names it read (pickled)
        names = here / NAMES
        fn = CellJob(script["CELL"], script["IMPORTS"], read_own(names) if names.exists() else None)
    else:
        fn = replaying(script[name], here)  # a steered run's sets and stop, made again at their steps
    args, kwargs = runlog.read_pickle(here / ARGUMENTS)
    return fn, args, kwargs, {"cluster": None, "trackers": None, "profile": None}
