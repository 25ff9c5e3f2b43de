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
    if not given:  # ./nbtrain-runs, made by nbtrain: private too
        assert stat.S_IMODE(os.stat(root.parent).st_mode) == 0o700
    assert not _read_by(stranger, [*tree, str(root.parent)], open_dir)


@slow
def test_a_tensorboard_directory_made_for_a_run_elsewhere_is_private(open_dir, umask_022, stranger, no_leftovers):
    log_dir = open_dir / "boards" / "this-run"  # made by the run, its parent too
    nbtrain.launch(train, 3, trackers=nbtrain.TensorBoard(log_dir=str(log_dir)), run_dir=open_dir / "run", **CPU2)
    tree = _tree(log_dir)
    assert {m for p, m in tree.items() if os.path.isdir(p)} == {0o700}
    assert {m for p, m in tree.items() if not os.path.isdir(p)} == {0o600}
    assert stat.S_IMODE(os.stat(open_dir / "boards").st_mode) == 0o700  # the parent it made: private too
    assert not _read_by(stranger, [*tree, str(open_dir / "boards")], open_dir)


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


# -- issue 54: the folders nbtrain makes on the way to a run directory, and checkpoints ----------

@pytest.fixture
def umask_000():
    old = os.umask(0o000)  # a shared machine's careless set-up: whatever is made with the usual mode is everyone's
    yield
    os.umask(old)


def modes(top, below) -> dict:
    """`top`'s and everything under it, up to `below` (a path under top), by mode."""
    from pathlib import Path

    found, path = {}, Path(below)
    while path != Path(top).parent:
        found[str(path.relative_to(top.parent))] = stat.S_IMODE(os.lstat(path).st_mode)
        path = path.parent
    return found


def test_the_parents_nbtrain_makes_for_a_run_dir_are_private_whatever_the_umask(tmp_path, umask_000):
    from nbtrain.common import runlog
    from nbtrain.notebook.live.work_queue import SavedResults

    SavedResults(tmp_path / "maps" / "of" / "embed", 3).close()  # map's run_dir (sweep's is made by the same helper)
    made = runlog.new_run_dir(tmp_path / "runs" / "here", "train")  # submit's default: nbtrain-runs/<time>-train
    partial = runlog.partial_dir(tmp_path / "given" / "parent", "run")  # submit's run_dir=given/parent/run
    for top, below in ((tmp_path / "maps", tmp_path / "maps" / "of" / "embed"), (tmp_path / "runs", made),
                       (tmp_path / "given", partial)):
        assert set(modes(top, below).values()) == {0o700}, modes(top, below)


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_a_checkpoint_is_0700_folders_and_0600_files_whatever_the_umask(tmp_path, umask):
    from nbtrain import Context

    old = os.umask(umask)
    try:
        ctx = Context()
        model = ctx.setup(torch.nn.Linear(4, 1))
        ctx.save_checkpoint(tmp_path / "checkpoints" / "last", model=model, step=3)
        ctx.save_checkpoint(tmp_path / "checkpoints" / "last", model=model, step=4)  # the swap keeps them private
    finally:
        os.umask(old)
    folders, files = set(), set()
    for folder, _, names in os.walk(tmp_path / "checkpoints"):
        folders.add(stat.S_IMODE(os.stat(folder).st_mode))
        files |= {stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) for name in names}
    assert (folders, files) == ({0o700}, {0o600})
    assert len(os.listdir(tmp_path / "checkpoints" / "last")) >= 2  # DCP's metadata and a shard
