"""The documentation site (docs/): it builds with warnings as errors, and has what a user looks for.

The build is the one README and docs/README.md give (`sphinx-build -W --keep-going -b html docs
OUT`); the checks read the HTML it wrote: every public name's API page with each parameter, every
notebook's page with its saved outputs, the measured figures from benchmarks/RESULTS.md. The fast
tests check the sources: the API page lists `nbtrain.__all__`, and every relative link in the
README and the pages points at a file that exists (so they work on GitHub too).
"""
from __future__ import annotations

import html
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

import nbtrain

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILDERS = ("sphinx", "myst_nb", "pydata_sphinx_theme", "numpydoc", "sphinx_copybutton")  # the docs extra
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def text_of(page: Path) -> str:
    """A built page's text: tags dropped, entities decoded, whitespace made single spaces."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", page.read_text(), flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [name for name in BUILDERS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                            "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert build.returncode == 0, f"the strict docs build failed:\n{build.stderr[-6000:]}"
    return out / "html"


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_page(site):
    pages = {p.stem for p in DOCS.glob("*.md")} - {"README"}  # docs/README.md says how to build; not a page
    assert {p.stem for p in site.glob("*.html")} >= pages | {"search", "genindex"}
    assert (site / "searchindex.js").stat().st_size > 10_000  # search covers the pages
    for name in nbtrain.__all__:
        assert (site / "api" / "generated" / f"nbtrain.{name}.html").exists(), name


@pytest.mark.slow
def test_the_api_page_of_launch_has_each_parameter_and_what_it_raises(site):
    page = (site / "api" / "generated" / "nbtrain.launch.html").read_text()
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    params = [stars.get(p.kind, "") + name for name, p in inspect.signature(nbtrain.launch).parameters.items()]
    assert len(params) > 10
    missing = [p for p in params if f"<dt><strong>{html.escape(p)}</strong>" not in page]
    assert not missing, f"launch's API page lacks the parameters {missing}"
    text = text_of(site / "api" / "generated" / "nbtrain.launch.html")
    assert "Returns : Result" in text and "Raises : " in text and "WorkerError" in text


@pytest.mark.slow
@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_notebook_page_carries_its_saved_outputs(site, notebook):
    cells = json.loads(notebook.read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    said = [line.strip() for o in outputs if o["output_type"] == "stream"
            for line in ANSI.sub("", "".join(o["text"])).splitlines() if len(line.strip()) > 20]
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert said or images, f"{notebook.name} has no saved outputs to show (notebooks/refresh_outputs.py)"
    page = site / "notebooks" / f"{notebook.stem}.html"
    text = "".join(text_of(page).split())  # without spaces: coloured output is split into spans
    shown = [line for line in said if "".join(line.split()) in text]
    assert len(shown) == len(said), f"{notebook.name}: outputs not on its page: {sorted(set(said) - set(shown))[:3]}"
    assert page.read_text().count("<img") >= images


@pytest.mark.slow
def test_a_notebook_page_gives_its_width_to_the_outputs(site):
    """A notebook's outputs (a stall message, a traceback) are read whole: no side lists on its page,
    and long output lines wrap instead of hiding behind a scroll bar."""
    page = (site / "notebooks" / "13_hangs_and_stragglers.html").read_text()
    guide = (site / "launching.html").read_text()
    assert "page-toc" in guide and "page-toc" not in page
    css = (site / "_static" / "wide.css").read_text()
    assert re.search(r"div\.cell_output pre[^{]*\{[^}]*white-space: pre-wrap", css)


@pytest.mark.slow
def test_the_figures_page_is_benchmarks_results_as_written(site):
    text = text_of(site / "benchmarks.html")
    rows = [line for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
            if line.startswith("| nbtrain")]
    assert rows
    for row in rows:
        assert " ".join(cell.strip() for cell in row.strip("|").split("|")) in text, row


@pytest.mark.slow
def test_the_guide_includes_the_readme_sections_it_shares(site):
    readme = (ROOT / "README.md").read_text()
    for page, marker in [("getting-started", "set-up"), ("compare", "compare"), ("development", "development"),
                         ("index", "intro")]:
        shared = readme.split(f"<!-- docs: {marker} -->")[1].split(f"<!-- docs: end {marker} -->")[0]
        words = re.sub(r"[`*]|\[|\]\([^)]*\)", "", shared.split("\n\n")[0]).split()
        assert " ".join(words[:12]) in text_of(site / f"{page}.html"), page


def test_the_api_page_lists_every_public_name_once():
    listed = re.findall(r"^   (\w+)$", (DOCS / "api" / "index.md").read_text(), flags=re.M)
    assert sorted(listed) == sorted(nbtrain.__all__)


def _links(markdown: str) -> list[str]:
    found = []
    for token in MarkdownIt("commonmark").parse(markdown):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(child.attrs["href"])
    return found


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_relative_links_point_at_files_that_exist(page):
    source = ROOT / page
    broken = []
    for href in _links(source.read_text()):
        if re.match(r"[a-z]+:", href) or href.startswith("#"):
            continue
        target = (source.parent / href.split("#")[0]).resolve()
        if not target.exists():
            broken.append(href)
    assert not broken, f"{page} links to files that do not exist: {broken}"


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert 'pip install -e ".[notebooks]" && jupyter lab notebooks/' in readme
    assert "sphinx-build -W --keep-going -b html docs docs/_build/html" in readme
    assert "| runs from a notebook cell |" in readme  # the comparison table
