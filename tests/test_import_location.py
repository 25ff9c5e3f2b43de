"""Where `import nbtrain` comes from, when Python starts next to a clone of the repository.

The package sits at the top of the clone (a flat layout, not src/). With the README's editable
install (`pip install -e .`), setuptools finds nbtrain through an import hook that Python asks
after the folders of sys.path; so Python started in the folder that *holds* a clone named
`nbtrain` finds that folder first, as an empty namespace package. docs/troubleshooting.md says so,
and what to do; these tests pin both the pitfall and the ways out, so the page stays true.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = "import nbtrain; print(nbtrain.__file__); print(hasattr(nbtrain, '__version__'))"


def _import_from(cwd: Path, **env) -> list[str]:
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.fixture
def parent_of_a_clone_named_nbtrain(tmp_path):
    (tmp_path / "nbtrain").symlink_to(ROOT, target_is_directory=True)  # `git clone .../nbtrain` makes ./nbtrain
    return tmp_path


@pytest.mark.slow
def test_inside_the_clone_and_anywhere_else_it_is_the_package(tmp_path):
    package = str(ROOT / "nbtrain" / "__init__.py")
    assert _import_from(ROOT, PYTHONSAFEPATH=None) == [package, "True"]
    assert _import_from(tmp_path, PYTHONSAFEPATH=None) == [package, "True"]


@pytest.mark.slow
def test_next_to_a_clone_named_nbtrain_the_folder_wins_unless_python_leaves_it_off_the_path(
        parent_of_a_clone_named_nbtrain):
    if not any(name.startswith("__editable__") and "nbtrain" in name for name in _site_packages_entries()):
        pytest.skip("nbtrain is not an editable install here: the pitfall is an editable install's")
    where = parent_of_a_clone_named_nbtrain
    assert _import_from(where, PYTHONSAFEPATH=None) == ["None", "False"]  # the clone's folder: a namespace
    package = str(ROOT / "nbtrain" / "__init__.py")
    # The ways out the troubleshooting page gives: Python without the start folder on its path...
    assert _import_from(where, PYTHONSAFEPATH="1") == [package, "True"]
    # ...or started anywhere else: in the clone itself, as the notebooks are.
    assert _import_from(where / "nbtrain", PYTHONSAFEPATH=None) == [package, "True"]


def _site_packages_entries() -> list[str]:
    import site

    return [name for folder in site.getsitepackages() if os.path.isdir(folder) for name in os.listdir(folder)]
