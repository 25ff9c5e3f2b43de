"""Sphinx configuration of nbtrain's documentation site (build: see docs/README.md).

Why Sphinx + MyST-NB + the PyData theme, and not MkDocs Material: it is what PyTorch and the
Jupyter projects use, so the site reads like the ones our users already know; autodoc imports the
real objects, so the API reference is the docstrings `help()` and `?` show, rendered by numpydoc
(the style they are written in); MyST-NB renders the notebooks with the outputs saved in them,
without running them; and `-W` turns every broken reference into a failed build.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbtrain

# The notebooks live in notebooks/ (where users open them); the site renders copies of them, made
# here, as pages under notebooks/ (a symlink would not do: MyST resolves it to a path outside docs/).
_here = Path(__file__).resolve().parent
(_here / "notebooks").mkdir(exist_ok=True)
for _notebook in sorted((_here.parent / "notebooks").glob("*.ipynb")):
    _copy = _here / "notebooks" / _notebook.name
    if not _copy.exists() or _copy.read_bytes() != _notebook.read_bytes():
        shutil.copyfile(_notebook, _copy)
for _copy in (_here / "notebooks").glob("*.ipynb"):  # one removed from notebooks/ leaves the site too
    if not (_here.parent / "notebooks" / _copy.name).exists():
        _copy.unlink()

project = "nbtrain"
author = "nbtrain contributors"
copyright = "nbtrain contributors"  # noqa: A001 (Sphinx's name)
release = version = nbtrain.__version__

extensions = [
    "myst_nb",                # MyST markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",               # the docstrings are numpydoc-style
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

# The user guide is the README's sections, split into pages; the README is the front page on
# GitHub and links here. Included files (benchmarks/RESULTS.md) are read from their place.
templates_path = ["_templates"]
exclude_patterns = ["_build", "_templates", "README.md", "**.ipynb_checkpoints"]
root_doc = "index"

# MyST: heading anchors so `[text](page.md#a-heading)` links work the way they do on GitHub.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# Notebooks are shown with the outputs saved in them (notebooks/refresh_outputs.py writes those);
# the site build never runs them.
nb_execution_mode = "off"
# A widget's saved state is not in the notebooks (only its text fallback is): show the text.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

# Pygments' IPython-traceback lexer stops at some characters in saved errors (an em dash) and
# falls back to plain text, which is what we would choose anyway: not a broken page.
suppress_warnings = ["misc.highlighting_failure"]

# API reference: autosummary writes one page per public name (docs/api/generated/).
autosummary_generate = True
# Inherited members too (Run and BackgroundRun share their steering methods), not those of the builtins.
autodoc_default_options = {"members": True, "inherited-members": "BaseException,list,dict,tuple,object"}
autodoc_typehints = "none"          # the signatures and the Parameters sections say the types
numpydoc_show_class_members = False  # autosummary lists them; numpydoc's own tables would repeat
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# Straight quotes as written: the pages quote code and figures (strategy='ddp') that a reader copies.
smartquotes = False

html_theme = "pydata_sphinx_theme"
html_title = f"nbtrain {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
# The guide's pages have no children to list on the left: give their width to the text. The
# notebooks' and the API's pages keep the list of their section.
# A notebook's page gives its width to the cells and their outputs (no side lists).
html_sidebars = {"*": [], "notebooks": ["sidebar-nav-bs"], "api/index": ["sidebar-nav-bs"], "notebooks/*": []}
html_theme_options = {
    "github_url": "https://github.com/nbtrain/nbtrain",
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 3,
    # The pages' own contents on the right, except on a notebook's page (its outputs take the width).
    "secondary_sidebar_items": {"*": ["page-toc", "sourcelink"], "api/**": ["page-toc", "sourcelink"],
                                "decisions/*": ["page-toc", "sourcelink"], "notebooks/*": []},
}


def _for_the_site(app, docname, source):
    """The pages are read on GitHub too. They link `../notebooks/X.ipynb`, which works there; on the
    site that notebook is the page rendered from its copy in docs/notebooks/. A line that starts
    with `<!-- github only -->` points GitHub's readers at what the site includes: not on the site."""
    text = source[0].replace("](../notebooks/", "](notebooks/")
    source[0] = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("<!-- github only -->"))


def setup(app):
    app.connect("source-read", _for_the_site)
