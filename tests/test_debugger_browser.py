"""JupyterLab's debugger panel on live ranks, in real JupyterLab and headless Chromium (Playwright):
the debugger switched on, a breakpoint clicked into the gutter of a `%%ranks` cell, the run stops
on the ranks, the panel shows the cell's frame and a rank's own variables, continue ends the cell,
whose ranks' lines are then in a selector per rank.
The protocol underneath is tested without a browser in test_debugger.py."""
from __future__ import annotations

import json
import time

import pytest

from test_browser import MISSING, _cell, _command, _notebook_json, _open, _snap, lab, page, shots  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")]

NOTEBOOK = "debugger.ipynb"
SETUP = '%load_ext nbtrain\nimport nbtrain\nranks = nbtrain.Ranks(devices=2, accelerator="cpu")'
CELL = '%%ranks\nx = ctx.rank * 10 + 7\ny = x + 1\nfor i in range(6):\n    print("done", y, i)'


def _run_cell(page, i: int) -> None:
    _cell(page, i).click()
    _command(page, "notebook:run-cell")


def _debugger_on(page) -> None:
    """The notebook toolbar's bug, clicked once JupyterLab enabled it (the kernel said it has a
    debugger): the cells get their breakpoint gutter."""
    gutter = _cell(page, 0).locator(".cm-gutter.cm-breakpoint-gutter")
    deadline = time.monotonic() + 60
    while gutter.count() == 0:
        assert time.monotonic() < deadline, "the debugger did not come on"
        button = page.locator(".jp-DebuggerBugButton:visible").first
        if button.is_enabled() and button.get_attribute("aria-pressed") != "true":
            button.click()
        time.sleep(1)


def test_a_gutter_breakpoint_in_a_ranks_cell_stops_the_ranks_and_continue_ends_the_cell(page, lab, shots):
    _, _, root = lab
    (root / NOTEBOOK).write_text(json.dumps(_notebook_json([SETUP, CELL])))
    _open(page, lab, NOTEBOOK)
    _debugger_on(page)
    _run_cell(page, 0)
    _cell(page, 0).locator(".jp-OutputArea-output", has_text="live ranks").wait_for(timeout=120_000)

    cell = _cell(page, 1)
    line = cell.locator(".cm-line").nth(2).bounding_box()  # `y = x + 1`, line 3
    gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter").bounding_box()
    page.mouse.click(gutter["x"] + gutter["width"] / 2, line["y"] + line["height"] / 2)
    try:
        page.locator(".jp-DebuggerBreakpoint").first.wait_for(timeout=15_000)  # listed in the panel
    finally:
        _snap(page, shots, "debugger-breakpoint-set")
    _run_cell(page, 1)

    frame = page.locator(".jp-DebuggerCallstackFrame").first
    frame.wait_for(timeout=120_000)
    assert "3" in frame.locator(".jp-DebuggerCallstackFrame-location").inner_text()
    variables = page.locator(".jp-DebuggerVariables-body").first
    variables.get_by_text("x", exact=True).first.wait_for(timeout=60_000)
    text = variables.inner_text()
    assert "17" in text or " 7" in text or "\n7" in text, text  # the rank whose stop the panel shows
    cell.scroll_into_view_if_needed()
    _snap(page, shots, "debugger-paused-on-ranks")

    _command(page, "debugger:continue")  # every paused rank goes on
    output = cell.locator(".jp-OutputArea-output")
    try:
        output.filter(has_text="[rank 1] done 18").wait_for(timeout=120_000)
    finally:
        _snap(page, shots, "debugger-continued")
    assert "[rank 0] done 8" in output.all_inner_texts()[0]
    # each rank's lines in its own tab, live; when the cell ended, a selector per rank that the page keeps
    tab = cell.locator(".nbtrain-rank-tabs details", has_text="rank 1 (6 lines)")
    tab.locator("summary").click()
    assert "done 18 5" in tab.inner_text() and "done 8" not in tab.inner_text()
    assert "PYDEV DEBUGGER WARNING" not in "".join(page.locator(".jp-OutputArea-output").all_inner_texts())
