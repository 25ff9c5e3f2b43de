"""start='spawn': ranks started by multiprocess's spawn context (nbtrain/placements/processes.py,
nbtrain/rank/spawned.py). Real launches from this process and real scripts; the interrupt, a
dying or hanging rank and a killed kernel are tests/test_hostile.py's, test_launch.py's and
test_process_tree.py's, parametrised by start."""
from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

import nbtrain
from conftest import timed_out_in_place
from nbtrain.common.errors import UnpicklableError, WorkerError
from test_launch import crash, stuck_in_barrier

CELL = """
import nbtrain, socket

class Point:
    def __init__(self, x):
        self.x = x

SCALE = 10

def make(offset):
    def shifted(x):
        return Point(SCALE * x + offset + nbtrain.context().rank)
    return shifted

shifted = make(offset=3)
twice = lambda x: (shifted(x).x, shifted(x + 1).x, type(shifted(x)).__qualname__)

def holds(conn):
    def train():
        return conn.fileno()
    return train
"""


def notebook():
    """The cell's names as a notebook has them: defined in `__main__`, so dill ships them by value."""
    namespace = {"__name__": "__main__"}
    exec(CELL, namespace)
    return namespace


@pytest.mark.slow
def test_notebook_lambdas_closures_and_classes_reach_spawned_ranks(no_leftovers):
    cell = notebook()
    result = nbtrain.launch(cell["twice"], 2, devices=2, accelerator="cpu", start="spawn", progress=False)
    assert result.values == [(23, 33, "Point"), (24, 34, "Point")]


@pytest.mark.slow  # it would start processes, were the pickling check not first
def test_an_unpicklable_object_is_named_by_its_path_before_any_rank_starts(no_leftovers, monkeypatch):
    started = []
    fork_exec = _posixsubprocess.fork_exec  # every spawn (multiprocess's, the watcher's) goes through it

    def spy(*args, **kwargs):
        started.append(args[0])
        return fork_exec(*args, **kwargs)

    monkeypatch.setattr(_posixsubprocess, "fork_exec", spy)
    cell = notebook()
    conn = cell["socket"].socket()
    try:
        with pytest.raises(UnpicklableError) as info:
            nbtrain.launch(cell["holds"](conn), devices=2, accelerator="cpu", start="spawn", progress=False)
    finally:
        conn.close()
    message = str(info.value)
    assert "the function `holds.<locals>.train` and its arguments cannot be sent" in message, message
    assert "train.<closure conn>: socket" in message and "open it inside the training function" in message, message
    assert started == []


LIVE_AT_EXIT = """
import os, nbtrain
ranks = nbtrain.Ranks(devices=2, accelerator="cpu", start="spawn", progress=False)
print("ranks", *ranks.eval("__import__('os').getpid()"), flush=True)
"""


@pytest.mark.slow
def test_a_script_that_exits_with_live_spawned_ranks_exits_and_takes_them(tmp_path):
    # multiprocess's exit hook joins every process it started, without a bound: live ranks serve
    # until stopped, so the script's exit would wait for ever. nbtrain's own hook, run first, ends them.
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent(LIVE_AT_EXIT))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stdout + run.stderr
    [line] = [line for line in run.stdout.splitlines() if line.startswith("ranks ")]
    pids = [int(pid) for pid in line.split()[1:]]
    assert len(pids) == 2
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


@pytest.mark.slow
def test_a_dying_spawned_rank_is_named_with_its_signal_and_its_last_words(capfd, no_leftovers):
    # Its pipes are the Connections multiprocess handed over: faulthandler's report reaches the notebook.
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(crash, "segv", devices=2, accelerator="cpu", start="spawn", progress=False)
    assert info.value.rank == 0 and "Signal 11 (SIGSEGV) received by PID" in str(info.value)
    assert "Fatal Python error: Segmentation fault" in info.value.traceback
    assert "[rank 0] about to die" in capfd.readouterr().out


@pytest.mark.slow
def test_a_hanging_spawned_rank_shows_its_stack_at_the_timeout(no_leftovers):
    error, timeout = timed_out_in_place(  # spawned ranks import torch first (seconds, more on a loaded machine)
        lambda timeout: nbtrain.launch(stuck_in_barrier, devices=2, accelerator="cpu", start="spawn",
                                       timeout=timeout, progress=False), "stuck_in_barrier", timeouts=(20, 60))
    assert f"timed out after {timeout} s; still running: ranks [0, 1]" in str(error)
    assert "--- rank 1 stack ---" in error.traceback and "slow_data_loading" in error.traceback
