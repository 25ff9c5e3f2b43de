"""The fast subset (`pytest -m "not slow"`) is what the README says: no processes, no kernels.

At the repository root so that it also holds for `pytest notebooks/`.
"""
import _posixsubprocess
import os
import subprocess

import pytest


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two workers for the whole suite, whose slow tests mostly
    wait on processes and kernels (the second worker takes a third off its time on 2 cores); none
    for a file, a directory or the fast subset, which two workers' start-up would only slow down."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and config.option.markexpr != "not slow"
    return 2 if whole else 0


# pytest-xdist (`--dist loadgroup`, pyproject's addopts): the tests of one file run in one
# worker, in order (a notebook's cells share its kernel, a module its fixtures); the tests below
# share a group across files as well, so they never run beside each other: Ray clusters, whose
# start on 2 loaded cores times out when two start at once, and the two-node test's Ray and SLURM.
TOGETHER = {
    "ray": ("tests/test_ray.py", "tests/test_ray_gone.py", "tests/test_two_nodes.py",
            "tests/test_scale.py::test_ray_8_actors", "tests/test_sweep.py::test_trials_as_ray_actors"),
}


def _group(item) -> str:
    for group, ids in TOGETHER.items():
        if any(item.nodeid == i or item.nodeid.startswith(i + ("::" if i.endswith(".py") else "[")) for i in ids):
            return group
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        # nbval runs every notebook cell in a Jupyter kernel: each cell is a slow test.
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))


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
