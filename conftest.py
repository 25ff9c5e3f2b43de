"""The fast subset (`pytest -m "not slow"`) is what the README says: no processes, no kernels.

At the repository root so that it also holds for `pytest notebooks/`.
"""
import _posixsubprocess
import os
import subprocess

import pytest


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    # nbval runs every notebook cell in a Jupyter kernel: each cell is a slow test.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


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
