"""The debugger page's screenshots, taken in real JupyterLab (headless Chromium, Playwright) and
written to docs/_static, each cropped to the cell and the debugger panel. Not a test (CI does not
run it); run it by hand after a change the pictures show:

    pytest -n 0 -p no:cacheprovider docs/debugger_screenshots.py

It uses the browser tests' JupyterLab server and page (tests/test_browser.py).
"""
# ruff: noqa: F811  (pytest's fixtures, imported, are this module's parameters)
from __future__ import annotations

import json
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from test_browser import MISSING, _cell, _command, _notebook_json, _open, lab, page  # noqa: E402,F401
from test_debugger_browser import _debugger_on, _run_cell  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")]

STATIC = pathlib.Path(__file__).resolve().parent / "_static"
NOTEBOOK = "debugger_screenshots.ipynb"
CELLS = [
    '%load_ext nbtrain\nimport nbtrain\nranks = nbtrain.Ranks(devices=2, accelerator="cpu")',
    '%%ranks\nx = ctx.rank * 10 + 7\ny = x + 1\nprint("done", y)',
    "import time\nimport torch\nimport torch.distributed as dist\n\n"
    "def train(nap):\n    ctx = nbtrain.context()\n    ctx.barrier()\n    t = torch.ones(3) * (ctx.rank + 1)\n"
    "    if ctx.rank == 1:\n        time.sleep(nap)  # rank 1 is stuck; rank 0 waits for it\n    dist.all_reduce(t)",
    'nbtrain.launch(train, 600, devices=2, accelerator="cpu", start="fork", progress=False, timeout=5)',
    "%debug",
]


def _shot(page, cell, name: str) -> None:
    """The cell and the debugger panel beside it, in one picture."""
    panel = page.locator(".jp-DebuggerSidebar:visible, #jp-debugger-sidebar:visible").first.bounding_box()
    box = cell.bounding_box()
    left, top = box["x"], min(box["y"], panel["y"])
    right, bottom = panel["x"] + panel["width"], max(box["y"] + box["height"], panel["y"] + panel["height"])
    page.screenshot(path=str(STATIC / f"{name}.png"), clip={"x": left, "y": top, "width": right - left,
                                                            "height": min(bottom - top, 560)})


def _wait_frame(page, text: str) -> None:
    deadline = time.monotonic() + 120
    frames = page.locator(".jp-DebuggerCallstackFrame")
    while not any(text in t for t in frames.all_inner_texts()):
        assert time.monotonic() < deadline, frames.all_inner_texts()
        time.sleep(0.5)


def test_take_the_debugger_screenshots(page, lab):
    _, _, root = lab
    (root / NOTEBOOK).write_text(json.dumps(_notebook_json(CELLS)))
    page.set_viewport_size({"width": 1500, "height": 900})
    _open(page, lab, NOTEBOOK)
    _debugger_on(page)
    _run_cell(page, 0)
    _cell(page, 0).locator(".jp-OutputArea-output", has_text="live ranks").wait_for(timeout=120_000)

    cell = _cell(page, 1)  # a breakpoint on `y = x + 1`: both ranks stop there
    line = cell.locator(".cm-line").nth(2).bounding_box()
    gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter").bounding_box()
    page.mouse.click(gutter["x"] + gutter["width"] / 2, line["y"] + line["height"] / 2)
    page.locator(".jp-DebuggerBreakpoint").first.wait_for(timeout=15_000)
    _run_cell(page, 1)
    _wait_frame(page, "3")
    page.locator(".jp-DebuggerVariables-body").first.get_by_text("x", exact=True).first.wait_for(timeout=60_000)
    time.sleep(1)
    _shot(page, cell, "debugger-paused")
    _command(page, "debugger:continue")
    cell.locator(".jp-OutputArea-output", has_text="done 18").wait_for(timeout=120_000)
    page.mouse.click(gutter["x"] + gutter["width"] / 2, line["y"] + line["height"] / 2)  # the breakpoint off

    _run_cell(page, 2)
    _run_cell(page, 3)  # stuck: its timeout ends it, its ranks kept for %debug
    _cell(page, 3).locator(".jp-OutputArea-output", has_text="are kept where they wait").wait_for(timeout=120_000)
    _run_cell(page, 4)  # %debug: the rank blamed opens in the panel, where it waits
    _wait_frame(page, "train")
    page.locator(".jp-DebuggerVariables-body").first.get_by_text("nap", exact=True).first.wait_for(timeout=60_000)
    time.sleep(1)
    _shot(page, _cell(page, 2), "debugger-stalled")
