"""The fast subset (`pytest -m "not slow"`) is what the README says: no processes, no kernels.

At the repository root so that it also holds for `pytest notebooks/`.
"""
import _posixsubprocess
import os
import resource
import subprocess
import time
from collections import defaultdict

import pytest


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    # nbval runs every notebook cell in a Jupyter kernel: each cell is a slow test.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: the order it collects is the controller's queue
        longest_first(items)


# Every way a test can start a process goes through one of these: subprocess (its own name for
# fork_exec, or posix_spawn), multiprocessing's spawn (fork_exec), its fork and ptys (os.fork/forkpty).
_STARTERS = [(os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
             (_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")]


def _watch_process_starts(item):
    """For a test not marked slow: let it run, then fail it if it started a process."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    started = []

    def watching(module, name, original):
        def starter(*args, **kwargs):
            started.append(f"{module.__name__}.{name}")
            return original(*args, **kwargs)
        return starter

    saved = [(module, name, getattr(module, name)) for module, name in _STARTERS if hasattr(module, name)]
    for module, name, original in saved:
        setattr(module, name, watching(module, name, original))
    try:
        result = yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    if started:
        pytest.fail(f"{item.nodeid} started a process ({', '.join(sorted(set(started)))}) but is not "
                    "marked slow: the fast subset starts no process or kernel. Add @pytest.mark.slow.",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # fixtures (a kernel, a server) start here
    return (yield from _watch_process_starts(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _watch_process_starts(item))


# -- the suite on several workers (pytest-xdist: pyproject's addopts has -n) ---------------------
# Each test file runs whole on one worker (its module-scoped kernel, its tests' order, a notebook's
# cells in one kernel). The Ray files that start clusters of their own share one worker, one after
# another: two Ray clusters starting at once on 2 cores miss Ray's own start-up deadlines (what they
# look for among the machine's processes is their worker's: tests/conftest.py's `this_workers`).
# SLURM needs no such care: each worker starts a cluster of its own (its own name, ports, state).
# The longest go first, so that no worker is left with a long file at the end (seconds measured
# serially on 2 cores with --durations=0). xdist's own --dist loadgroup cannot do this: under
# pytest 9 it no longer changes the tests' ids, and splits a file's tests across workers.
SHARED_WORKER = {"tests/test_ray.py": "ray", "tests/test_ray_gone.py": "ray", "tests/test_two_nodes.py": "ray",
                 "tests/test_scale.py": "ray",
                 # W&B's service and its temporary folders are looked for machine-wide
                 "tests/test_trackers.py": "trackers", "tests/test_readme.py": "trackers",
                 "notebooks/10_trackers_profiles.ipynb": "trackers",
                 # DeepSpeed's shared-memory buffers are looked for machine-wide
                 "tests/test_deepspeed.py": "deepspeed", "tests/test_quiet_cells.py": "deepspeed",
                 "notebooks/07_sharded.ipynb": "deepspeed"}
MEASURED = {"ray": 350, "tests/test_submit.py": 135, "trackers": 168, "tests/test_hostile.py": 128,
            "tests/test_slurm.py": 98, "tests/test_libraries.py": 74,
            "tests/test_launch.py": 64, "deepspeed": 93, "tests/test_sweep.py": 57,
            "tests/test_doctor.py": 53, "tests/test_template.py": 51, "tests/test_browser.py": 50,
            "tests/test_rendezvous.py": 49, "tests/test_process_tree.py": 46, "tests/test_ddp_tutorial_series.py": 46,
            "tests/test_packaging.py": 42, "tests/test_script.py": 41, "tests/test_mapping.py": 38,
            "tests/test_run_files.py": 38, "tests/test_cli.py": 35, "tests/test_restarts.py": 34}


def worker_group(nodeid: str) -> str:
    """The unit of work one worker runs whole: the test's file, or the group its file shares."""
    path = nodeid.split("::")[0]
    return SHARED_WORKER.get(path, path)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WholeFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # the workers' collection order (below) is the order
    return WholeFiles(config, log)


def longest_first(items) -> None:
    """Order the groups by their measured time, longest first; within a group, as collected."""
    first = {group: index for index, group in enumerate(dict.fromkeys(worker_group(i.nodeid) for i in items))}
    items.sort(key=lambda i: (-MEASURED.get(worker_group(i.nodeid), 0), first[worker_group(i.nodeid)]))


# Where a run's time went, per worker: what each was busy with and when it ran out of work. A
# worker done long before the others shows what to split or move (MEASURED, SHARED_WORKER).
_BUSY: dict = defaultdict(float)
_DONE: dict = {}
_START = time.monotonic()


# CPU, not wall time, is what the suite runs short of on 2 cores. A test's CPU here is its
# worker's own and that of the processes the worker reaped since the test's previous phase: a
# module's kernel (with the ranks it reaped) counts when it is shut down, so per file. SLURM's
# tasks and daemons outside the worker's tree are not counted: the machine's total says how much.
_CPU: dict = defaultdict(float)  # by test: a module's kernel counts in its file's last test
_LAST_CPU = 0.0  # the CPU counted so far: from the end of collection


def _cpu_seconds() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _machine_cpu_seconds() -> float:
    with open("/proc/stat") as stat:  # first line: cpu user nice system idle iowait irq softirq ...
        ticks = stat.readline().split()[1:]
    return (sum(map(int, ticks[:3])) + sum(map(int, ticks[5:8]))) / os.sysconf("SC_CLK_TCK")


_MACHINE_START = _machine_cpu_seconds()


def pytest_collection_finish(session):
    global _LAST_CPU
    _LAST_CPU = _cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    global _LAST_CPU
    report = yield
    now = _cpu_seconds()
    report.user_properties.append(("cpu_s", round(now - _LAST_CPU, 3)))
    _LAST_CPU = now
    return report


def pytest_runtest_logreport(report):
    _CPU[report.nodeid] += dict(report.user_properties).get("cpu_s", 0.0)
    node = getattr(report, "node", None)  # set on the controller for a worker's report
    if node is not None:
        worker = node.gateway.id
        _BUSY[worker] += report.duration
        _DONE[worker] = time.monotonic() - _START


def pytest_terminal_summary(terminalreporter):
    if _BUSY:
        terminalreporter.write_sep("=", "where each worker's time went")
        for worker in sorted(_BUSY):
            terminalreporter.write_line(f"{worker}: {_BUSY[worker]:.0f} s in tests, out of work at "
                                        f"{_DONE[worker]:.0f} s")
    if _CPU:
        counted, machine = sum(_CPU.values()), _machine_cpu_seconds() - _MACHINE_START
        terminalreporter.write_sep("=", "where the CPU went, by file (the tests' processes they reaped)")
        terminalreporter.write_line(f"{counted:.0f} s of CPU counted; the machine's, in this run: {machine:.0f} s")
        by_file: dict = defaultdict(float)
        for test, seconds in _CPU.items():
            by_file[test.split("::")[0]] += seconds
        _write_costliest(terminalreporter, by_file)
        terminalreporter.write_sep("=", "where the CPU went, by test (the 25 costliest)")
        _write_costliest(terminalreporter, _CPU)


def _write_costliest(terminalreporter, seconds_by_name: dict) -> None:
    for name, seconds in sorted(seconds_by_name.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
