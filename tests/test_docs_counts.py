"""What the README and the docs say of the notebooks, held to the notebooks themselves: how many
there are, the badges and install cell each starts with, and no saved output that the docs site
would draw as an empty box. Files only: no process."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
        "seventeen eighteen nineteen twenty".split()


def refresh_outputs():
    """notebooks/refresh_outputs.py, whose rule for an empty output the saved notebooks keep to."""
    spec = importlib.util.spec_from_file_location("refresh_outputs", ROOT / "notebooks" / "refresh_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_and_the_notebooks_page_count_the_notebooks_there_are():
    said = re.search(r"\| \[Notebooks\]\(docs/notebooks\.md\) \| (\w+) notebooks", (ROOT / "README.md").read_text())
    assert said and said.group(1) == WORDS[len(NOTEBOOKS)], (said and said.group(1), len(NOTEBOOKS))
    listed = re.findall(r"^\d+\. \[[^]]+\]\(\.\./notebooks/([^)]+\.ipynb)\)", (ROOT / "docs" / "notebooks.md").read_text(),
                        flags=re.M)
    assert listed == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_starts_with_its_badges_and_the_install_cell(notebook):
    assert "Every notebook has Colab, Kaggle and Binder badges at the top" in (ROOT / "docs" / "notebooks.md").read_text()
    cells = json.loads(notebook.read_text())["cells"]
    top = "".join(cells[0]["source"])
    for badge in (f"https://colab.research.google.com/github/nbtrain/nbtrain/blob/main/notebooks/{notebook.name}",
                  f"https://kaggle.com/kernels/welcome?src=https://github.com/nbtrain/nbtrain/blob/main/notebooks/"
                  f"{notebook.name}",
                  f"https://mybinder.org/v2/gh/nbtrain/nbtrain/main?labpath=notebooks%2F{notebook.name}"):
        assert f"]({badge})" in top, f"{notebook.name}'s first cell lacks the badge {badge}"
    install = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    assert 'find_spec("nbtrain") is None' in install and '%pip install -q "nbtrain @ git+' in install


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_saved_output_is_empty(notebook):
    empty = refresh_outputs().empty
    cells = json.loads(notebook.read_text())["cells"]
    found = [(i, o["output_type"]) for i, c in enumerate(cells) for o in c.get("outputs", []) if empty(o)]
    assert not found, f"{notebook.name}: outputs the docs site shows as empty boxes (cell, kind): {found}"
