"""The rank side of an exported run (`nbtrain.export`) under sbatch: its script calls `main` on
every rank that srun's torchrun starts (`run.sh` runs the job under `launch` instead, see
`notebook/detached/exported_job.py`). No notebook, no channel: the Context comes from
torchrun's environment, and rank 0 prints its return value and writes it, pickled, to the run directory's value.pkl."""
from __future__ import annotations

import os
from pathlib import Path

from ..common import runlog
from ..common.pickling import ship_bytes
from ..common.private import private_dir
from .context import Context, set_current
from .steer import replaying

ARGUMENTS = "arguments.pkl"  # the call's arguments, pickled at export
VALUE = "value.pkl"  # rank 0's return value, in the run directory


def main(fn, here: str | Path) -> None:
    here = Path(here)
    args, kwargs = runlog.read_pickle(here / ARGUMENTS)  # only from a file of ours, no link
    run_dir = Path(os.environ.setdefault("NBTRAIN_RUN_DIR", str(here / "run")))
    private_dir(run_dir)  # ctx.run_dir, where the code keeps checkpoints
    ctx = Context.from_environ(os.environ)
    set_current(ctx)
    try:
        value = ctx.prepare_return(replaying(fn, here)(*args, **kwargs))
    finally:
        ctx.close()
        set_current(None)
    if ctx.rank == 0:
        runlog.write_whole(run_dir / VALUE, ship_bytes(value))
        print(f"rank 0 returned: {value!r}", flush=True)
