"""A local module edited on disk and reloaded in the notebook: live ranks follow the reload, and a
launch runs the reloaded code whatever starts its ranks (forks of the kernel inherit its copy;
template, spawned and torchrun ranks import the file). Real kernels, real files."""
import os

import pytest

from nbtrain.notebook.run.reloads import ModuleVersions


def write_module(path, answer: int) -> None:
    path.write_text(f"def answer():\n    return {answer}  # version {'x' * answer}\n")
    stamp = os.stat(path).st_mtime + answer  # a later mtime: the import system never takes a stale .pyc
    os.utime(path, (stamp, stamp))


@pytest.fixture(scope="module")
def one_kernel():
    """One kernel for the module (a kernel is seconds of CPU): each test imports its own `edited`."""
    from conftest import Kernel

    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run("%load_ext nbtrain\nimport importlib, os, sys, nbtrain")
        assert error is None, error
        yield kernel
    finally:
        kernel.close()


@pytest.fixture
def nb(one_kernel, tmp_path):
    """The kernel with a fresh `edited` (version 1) from this test's folder: the last test's module
    is forgotten and its folder off the path, its template stopped (it imported the old file)."""
    write_module(tmp_path / "edited.py", 1)
    _, _, error, _ = one_kernel.run(f"sys.modules.pop('edited', None)\nsys.path.insert(0, {str(tmp_path)!r})\n"
                                    "os.chdir(sys.path[0])\nimport edited")
    assert error is None, error
    yield one_kernel
    _, _, error, _ = one_kernel.run(f"nbtrain.stop_template()\nsys.path.remove({str(tmp_path)!r})")
    assert error is None, error


@pytest.mark.slow
def test_live_ranks_follow_a_reload_in_the_notebook(nb, tmp_path):
    _, _, error, _ = nb.run("ranks = nbtrain.Ranks(devices=2, accelerator='cpu')\nranks.exec('import edited')")
    try:
        assert error is None, error
        assert nb.value("ranks.eval('edited.answer()')") == [1, 1]
        write_module(tmp_path / "edited.py", 2)
        out, err, error, _ = nb.run("importlib.reload(edited)\n_seen = ranks.eval('edited.answer()')")
        assert error is None, error
        assert nb.value("_seen") == [2, 2]
        assert "live ranks reloaded edited, as the notebook did" in out + err
        assert nb.value("ranks.run(edited.answer).values") == [2, 2]  # the function by reference: the new one
        out, err, _, _ = nb.run("_again = ranks.eval('edited.answer()')")
        assert "reloaded" not in out + err and nb.value("_again") == [2, 2]  # said once, for the one reload
    finally:
        nb.run("ranks.close()")


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "template", "spawn"])
def test_every_start_runs_the_reloaded_module(nb, tmp_path, start):
    launch = f"nbtrain.launch(edited.answer, devices=2, accelerator='cpu', start={start!r}, progress=False).values"
    assert nb.value(launch) == [1, 1]
    write_module(tmp_path / "edited.py", 3)
    _, _, error, _ = nb.run("importlib.reload(edited)")
    assert error is None, error
    assert nb.value(launch) == [3, 3]


def test_a_reload_is_told_apart_from_a_first_import():
    import importlib
    import types

    module = importlib.import_module("nbtrain.rank.reloads")
    assert isinstance(module, types.ModuleType)
    versions = ModuleVersions()
    assert versions.reloaded() == []
    importlib.reload(module)
    assert versions.reloaded() == ["nbtrain.rank.reloads"]
    assert versions.reloaded() == []


def test_every_reload_is_seen_though_nothing_scans_while_nothing_changed():
    """The check is O(1) while sys.modules' tail is as last seen: each kind of reload still moves it."""
    import importlib
    import json.decoder
    import json.encoder

    versions = ModuleVersions()
    assert versions.reloaded() == []
    importlib.reload(json.decoder)  # now the last module
    assert versions.reloaded() == ["json.decoder"]
    importlib.reload(json.decoder)  # the last module reloaded again: same name, same count, a new spec
    assert versions.reloaded() == ["json.decoder"]
    importlib.reload(json.encoder)
    importlib.reload(json.decoder)  # two at once, the last one last again
    assert sorted(versions.reloaded()) == ["json.decoder", "json.encoder"]
    importlib.reload(json.encoder)
    import nbtrain.rank.reloads
    importlib.reload(nbtrain.rank.reloads)
    import wave  # noqa: F401 - a module imported after the reloads: the count changed as well
    assert sorted(versions.reloaded()) == ["json.encoder", "nbtrain.rank.reloads"]
    assert versions.reloaded() == []


@pytest.mark.slow
def test_a_module_edited_and_not_reloaded_is_said_in_one_line_until_reloaded(nb, tmp_path):
    launch = "_r = nbtrain.launch(edited.answer, devices=2, accelerator='cpu', start='fork', progress=False)"
    out, err, error, _ = nb.run(launch)
    assert error is None and "changed on disk" not in out + err, (error, out + err)
    write_module(tmp_path / "edited.py", 4)
    out, err, error, _ = nb.run(launch)
    assert error is None, error
    said = [line for line in (out + err).splitlines() if "changed on disk" in line]
    assert len(said) == 1 and "importlib.reload(edited)" in said[0] and "edited.py" in said[0], out + err
    assert nb.value("_r.values") == [1, 1]  # the fork ran the notebook's copy, as the line says
    out, err, error, _ = nb.run("importlib.reload(edited)\n" + launch)
    assert error is None and "changed on disk" not in out + err, out + err
    assert nb.value("_r.values") == [4, 4]
