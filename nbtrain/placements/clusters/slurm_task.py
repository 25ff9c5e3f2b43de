"""A task of a launch's SLURM job, on its node: one rank.

Each task reads its place from submitit's `JobEnvironment`: global and local rank, node, and the
job's host names (the first is the master).
"""
from __future__ import annotations

import signal
import sys

from ...rank.remote_entry import rank_entry
from .base import rank_vars

TIME_WARNING = 90  # seconds: submitit's default --signal=USR2@90


def rank_task(base: dict, first: tuple | None, live: bool) -> int:
    """One rank: a task of the job (run by submitit's `python -m submitit.core._submit`)."""
    import submitit

    env = submitit.JobEnvironment()
    # nbtrain drives these ranks from the notebook: a cancel ends them now (submitit would
    # ignore SIGTERM, waiting to requeue a preempted job), and the time limit is announced.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, _time_limit_near)
    per_node = env.num_tasks // env.num_nodes
    environ = {**base, **rank_vars(env.global_rank, env.local_rank, per_node, env.node, env.hostnames[0])}
    return rank_entry(environ, first, live)


def _time_limit_near(signum, frame) -> None:
    print(f"nbtrain: SLURM says this job reaches its time limit in about {TIME_WARNING} s; it is then stopped.",
          file=sys.stderr, flush=True)
