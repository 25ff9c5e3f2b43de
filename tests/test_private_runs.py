"""What a run writes outside submit is its user's alone, whatever the umask: a tracked launch's
directory and what its trackers and profile write there (the run's arguments among it), script
mode's job directory. Checked by mode, and by a second local account that tries to read it."""
import os
import stat
import sys

import pytest
import torch

import nbtrain
from stranger import stranger  # noqa: F401 - a fixture

slow = pytest.mark.slow
CPU2 = {"devices": 2, "accelerator": "cpu", "start": "fork", "progress": False, "timeout": 180}

# What another account tries on every path it is given: to list a directory, to read a file.
READ_ALL = r'''
import json, os, sys
got = {}
for path in json.loads(sys.argv[1]):
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        got[path] = "read"
    except OSError as exc:
        got[path] = type(exc).__name__
print(json.dumps(got))
'''


def train(steps, optimizer_name="sgd", note="a string argument: recorded as a hyper-parameter"):
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 1))
    for _ in ctx.progress(range(steps)):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        ctx.log("loss", loss.item())
    return ctx.rank


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual one: what a library makes is readable by everyone
    yield
    os.umask(old)


@pytest.fixture
def open_dir():
    """A directory anyone may enter (pytest's own temporary ones are closed to others): the
    run's private directory must be what stops the stranger."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="nbtrain-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def _tree(root):
    """Every directory and file below `root` (itself included), with its mode."""
    found = {str(root): stat.S_IMODE(os.lstat(root).st_mode)}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


def _read_by(user, paths, reachable):
    """Which of `paths` the stranger could read or list; `reachable`, a directory above them, it
    must be able to list (else nothing was tried)."""
    import json

    got = user.json(READ_ALL, json.dumps(sorted({*paths, str(reachable)})))
    assert got.pop(str(reachable)) == "read", f"the stranger cannot even reach {reachable}"
    return [path for path, what in got.items() if what == "read"]


@slow
@pytest.mark.parametrize("given", [False, True], ids=["default-run-dir", "given-run-dir"])
def test_a_tracked_launchs_directory_is_private_whatever_the_umask(given, open_dir, monkeypatch, umask_022, stranger,
                                                                    no_leftovers):
    monkeypatch.chdir(open_dir)
    run_dir = None
    if given:  # there already, as wide as the umask makes it
        run_dir = open_dir / "mine"
        run_dir.mkdir()
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o755
    result = nbtrain.launch(train, 6, "adam", trackers=["tensorboard", "mlflow"], profile=nbtrain.Profile(steps=2),
                            run_dir=run_dir, **CPU2)
    assert result.values == [0, 1]
    root = run_dir if given else next((open_dir / "nbtrain-runs").iterdir())
    tree = _tree(root)
    dirs = {p: m for p, m in tree.items() if os.path.isdir(p)}
    files = {p: m for p, m in tree.items() if not os.path.isdir(p)}
    assert any(p.endswith("rank1") for p in dirs) and any(p.endswith("profile") for p in dirs), sorted(tree)
    assert set(dirs.values()) == {0o700}, dirs
    # The files the trackers write (the run's arguments are in them): 0600 too.
    recorded = {p: m for p, m in files.items() if "tfevents" in p or p.endswith("mlflow.db")}
    assert len(recorded) == 3 and set(recorded.values()) == {0o600}, files
    assert not _read_by(stranger, tree, root.parent)


@slow
def test_a_tensorboard_directory_made_for_a_run_elsewhere_is_private(open_dir, umask_022, stranger, no_leftovers):
    log_dir = open_dir / "boards" / "this-run"  # made by the run, its parent too
    nbtrain.launch(train, 3, trackers=nbtrain.TensorBoard(log_dir=str(log_dir)), run_dir=open_dir / "run", **CPU2)
    tree = _tree(log_dir)
    assert {m for p, m in tree.items() if os.path.isdir(p)} == {0o700}
    assert {m for p, m in tree.items() if not os.path.isdir(p)} == {0o600}
    assert not _read_by(stranger, tree, open_dir / "boards")


def probe_job_dir(user):
    job_dir = os.path.dirname(os.path.abspath(sys.argv[0]))  # the bootstrap script's directory
    tree = _tree(job_dir)
    dirs = {m for p, m in tree.items() if os.path.isdir(p)}
    umask = os.umask(0o022)  # the rank's own: the kernel's, whatever the launcher ran with
    return dirs, _read_by(user, tree, os.path.dirname(job_dir)), umask


@slow
def test_a_script_launchs_job_directory_is_private_whatever_the_umask(umask_022, stranger, no_leftovers):
    result = nbtrain.launch(probe_job_dir, stranger, **{**CPU2, "start": "torchrun"})
    dirs, read, umask = result.values[0]
    assert dirs == {0o700} and read == [] and umask == 0o022, result.values[0]
