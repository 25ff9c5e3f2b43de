"""What a newcomer installs is what the notebooks, Colab, Kaggle and Binder need; the package builds and installs."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import metadata, packages_distributions, requires
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Cell magics whose body is Python (for %%nbtrain, the code every rank runs).
PYTHON_CELL_MAGICS = {"nbtrain", "time", "timeit", "capture", "prun"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str | None) -> set[str]:
    """nbtrain's requirements (normalised names): its own dependencies, or one extra's."""
    names = set()
    for line in requires("nbtrain") or []:
        req = Requirement(line)
        in_extra = req.marker is not None and req.marker.evaluate({"extra": extra or ""})
        if (extra is None and req.marker is None) or (extra is not None and in_extra):
            names.add(normalise(req.name))
    return names


def repository() -> str:
    urls = dict(entry.split(", ", 1) for entry in metadata("nbtrain").get_all("Project-URL") or [])
    assert "Repository" in urls, f"pyproject.toml [project.urls] has no Repository: {urls}"
    return urls["Repository"]


def python_of(cell) -> str:
    source = cell.source
    if source.startswith("%%"):
        magic, _, body = source.partition("\n")
        if magic[2:].split()[0] not in PYTHON_CELL_MAGICS:
            return ""
        source = body
    return TransformerManager().transform_cell(source)


def imported_packages(path: Path) -> dict[str, int]:
    """Top-level packages a notebook imports (in any cell, at any depth) -> the first cell that does."""
    found = {}
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(python_of(cell))
        except SyntaxError as exc:
            pytest.fail(f"{path.name} cell {index} is not Python: {exc}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], index)
    return found


def test_the_notebooks_extra_covers_every_notebook_import():
    own, extra = declared(None), declared("notebooks")
    providers = packages_distributions()
    problems = []
    for path in NOTEBOOKS:
        for package, cell in sorted(imported_packages(path).items()):
            if package == "nbtrain" or package in sys.stdlib_module_names:
                continue
            dists = {normalise(d) for d in providers.get(package, [])}
            if not dists:
                problems.append(f"{path.name} cell {cell} imports {package}, which no installed distribution "
                                "provides: add its distribution to the `notebooks` extra in pyproject.toml")
            elif not dists & (own | extra):
                problems.append(f"{path.name} cell {cell} imports {package} (from {', '.join(sorted(dists))}), "
                                "which is neither nbtrain's dependency nor in its `notebooks` extra")
    assert not problems, "\n".join(problems)
    assert "jupyterlab" in extra  # to open them


def test_the_test_extra_brings_the_notebooks_extra_and_accelerate():
    # CI installs `.[test]` and runs the notebooks, and the accelerate launcher test.
    assert "nbtrain" in declared("test") and "accelerate" in declared("test")


INSTALL = re.compile(r'if importlib\.util\.find_spec\("nbtrain"\) is None:\n'
                     r'    %pip install -q "nbtrain @ git\+(?P<url>\S+)"(?P<more>[^\n]*)$')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_each_notebook_starts_with_an_install_cell_that_works_on_colab_and_does_nothing_in_ci(path):
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    assert cells, f"{path.name} has no code cell"
    first = cells[0].source
    found = INSTALL.search(first)
    example = ('import importlib.util\n\nif importlib.util.find_spec("nbtrain") is None:\n'
               f'    %pip install -q "nbtrain @ git+{repository()}"')
    assert found, f"{path.name}: the first code cell must install nbtrain where it is missing, e.g.\n{example}"
    assert found["url"] == repository()
    # Colab's and Kaggle's torch is kept: no torch in the line; anything else it installs is a notebook need.
    more = {normalise(Requirement(r).name) for r in found["more"].split()}
    assert "torch" not in more and more <= declared("notebooks"), more


def test_readme_colab_cell_installs_from_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert f'%pip install -q "nbtrain @ git+{repository()}"' in readme
    assert "%pip install nbtrain\n" not in readme and "`%pip install nbtrain`" not in readme


def test_binder_installs_cpu_torch_and_the_notebooks_extra():
    requirements = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert "--index-url https://download.pytorch.org/whl/cpu" in requirements and "torch" in requirements
    assert 'pip install --no-cache-dir -e ".[notebooks]"' in (ROOT / "binder" / "postBuild").read_text()


def test_license_matches_the_declared_one():
    assert metadata("nbtrain")["License-Expression"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


def run(cmd, cwd, timeout=600, env=None):
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_the_built_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path):
    # `python -m build` makes the sdist, then the wheel from the unpacked sdist: a wheel here means
    # the sdist carries what a build needs.
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    version = metadata("nbtrain")["Version"]
    assert wheel.name == f"nbtrain-{version}-py3-none-any.whl"

    names = zipfile.ZipFile(wheel).namelist()
    info = f"nbtrain-{version}.dist-info/"
    junk = [n for n in names if not (n.startswith("nbtrain/") or n.startswith(info)) or n.endswith(".pyc")]
    assert not junk, f"the wheel carries more than the package: {junk}"
    assert f"{info}licenses/LICENSE" in names and "nbtrain/display/widgets.py" in names
    assert "nbtrain/py.typed" in names  # PEP 561: type checkers read nbtrain's annotations
    with tarfile.open(sdist) as tar:
        carried = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    assert {"README.md", "LICENSE", "pyproject.toml", "nbtrain/__init__.py"} <= carried
    assert not [n for n in carried if n.split("/")[0] in ("tests", "notebooks", "benchmarks", "binder")]

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python, exe = venv / "bin" / "python", venv / "bin" / "nbtrain"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # CPU torch first, from local disk: a bare `torch` requirement would pull a CUDA build.
    # --no-compile: byte-compiling all of torch is 15 s of CPU; the demo compiles what it imports.
    run([python, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0"], cwd=tmp_path, env=env)
    run([python, "-m", "pip", "install", "-q", "--no-compile", str(wheel)], cwd=tmp_path, env=env)

    where = run([python, "-c", "import nbtrain; print(nbtrain.__file__, nbtrain.__version__)"], cwd=tmp_path, env=env)
    assert where.split() == [str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                                 / "site-packages" / "nbtrain" / "__init__.py"), version]
    assert run([exe, "--version"], cwd=tmp_path, env=env).strip() == f"nbtrain {version}"
    out = run([exe, "demo", "--devices", "2", "--accelerator", "cpu"], cwd=tmp_path, env=env)
    assert "rank 1: last batch loss" in out and "effective batch size: 128" in out
