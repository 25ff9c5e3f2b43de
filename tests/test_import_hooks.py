"""common/import_hooks.py: a function run on a module right after its import, with real imports
of small modules written for each test."""
import importlib
import logging
import sys

import pytest

from nbtrain.common import import_hooks
from nbtrain.common.import_hooks import when_imported


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh importable package name for each test; forgotten again afterwards."""
    name = f"hooked_{tmp_path.name.replace('-', '_')}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name, tmp_path / name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    import_hooks._finder.waiting.pop(name, None)
    import_hooks._finder.waiting.pop(name + ".sub", None)


def test_runs_right_after_the_import_once_and_then_steps_aside(package):
    name, _ = package
    seen = []
    when_imported(name, lambda module: seen.append(module.value))
    assert seen == [] and import_hooks._finder in sys.meta_path
    module = importlib.import_module(name)
    assert seen == [1]
    assert name not in import_hooks._finder.waiting
    # it leaves sys.meta_path once nothing waits (torch.cuda may: `import nbtrain` waits for it)
    assert (import_hooks._finder in sys.meta_path) == bool(import_hooks._finder.waiting)
    assert "exec_module" not in vars(module.__spec__.loader)  # the loader as it was
    importlib.reload(module)
    assert seen == [1]


def test_runs_at_once_for_an_imported_module(package):
    name, _ = package
    module = importlib.import_module(name)
    seen = []
    when_imported(name, seen.append)
    assert seen == [module]


def test_a_submodule_and_a_function_added_twice_runs_once(package):
    name, folder = package
    (folder / "sub.py").write_text("value = 2\n")
    seen = []

    def note(module):
        seen.append(module.value)

    when_imported(name + ".sub", note)
    when_imported(name + ".sub", note)
    importlib.import_module(name + ".sub")
    assert seen == [2]


def test_a_failing_function_is_logged_and_the_import_goes_on(package, caplog):
    name, _ = package

    def broken(module):
        raise RuntimeError("no such attribute")

    when_imported(name, broken)
    with caplog.at_level(logging.WARNING, logger="nbtrain.common.import_hooks"):
        module = importlib.import_module(name)
    assert module.value == 1
    assert f"nbtrain: could not prepare {name}: no such attribute" in caplog.text


def test_a_failed_import_leaves_the_function_waiting_for_the_next_try(package):
    name, folder = package
    (folder / "__init__.py").write_text("raise ImportError('not yet')\n")
    seen = []
    when_imported(name, seen.append)
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module(name)
    assert seen == []
    (folder / "__init__.py").write_text("value = 3\n")
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    assert seen == [module]


def test_a_module_no_finder_finds_is_left_to_fail_as_usual(package):
    name, _ = package
    seen = []
    when_imported(name + "_missing", seen.append)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name + "_missing")
        assert seen == []
    finally:
        import_hooks._finder.waiting.pop(name + "_missing", None)
