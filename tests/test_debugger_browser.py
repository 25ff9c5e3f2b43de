"""JupyterLab's debugger panel on live ranks, in real JupyterLab and headless Chromium (Playwright):
the debugger switched on, a breakpoint clicked into the gutter of a `%%ranks` cell, the run stops
on the ranks, the panel shows the cell's frame and a rank's own variables, continue ends the cell,
whose ranks' lines are then in a selector per rank. Then a breakpoint in a function that
`nbtrain.launch` runs: both ranks stop (threads `rank 0`, `rank 1`), the panel shows the stopped
rank's frame and its own variables, each rank's lines are in its own live tab, continue ends the
launch. JupyterLab 4's panel has no thread list (it shows the thread that stopped last): the
threads are read from its debugger service, as the page got them.
The protocol underneath is tested without a browser in test_debugger.py."""
from __future__ import annotations

import json
import re
import time

import pytest

from test_browser import MISSING, _cell, _command, _notebook_json, _open, _snap, lab, page, shots  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")]

NOTEBOOK = "debugger.ipynb"
SETUP = '%load_ext nbtrain\nimport nbtrain\nranks = nbtrain.Ranks(devices=2, accelerator="cpu")'
CELL = '%%ranks\nx = ctx.rank * 10 + 7\ny = x + 1\nfor i in range(6):\n    print("done", y, i)'
FUNCTION = ('def train(n):\n    rank = nbtrain.context().rank\n    for i in range(n):\n        print(f"rank {rank} says {i}")\n'
            '    value = rank * 100 + n\n    return value')
LAUNCH = 'result = nbtrain.launch(train, 6, devices=2, accelerator="cpu", start="fork")\nprint("values", result.values)'
# The debugger service's `stopped` events as the page gets them, kept (its panel shows the last one's thread only).
KEEP_STOPS = """() => {
  const service = window.jupyterapp.pluginRegistry._plugins.get('@jupyterlab/debugger-extension:service').service;
  window.nbtrainStops = [];
  service.eventMessage.connect((_, event) => { if (event.event === 'stopped') window.nbtrainStops.push(event.body); });
}"""
THREADS = """async () => {
  const service = window.jupyterapp.pluginRegistry._plugins.get('@jupyterlab/debugger-extension:service').service;
  return (await service.session.sendRequest('threads', {})).body.threads;
}"""


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


def _break_at(page, cell, line: int) -> None:
    """A click in the breakpoint gutter beside `cell`'s `line` (1 is its first)."""
    box = cell.locator(".cm-line").nth(line - 1).bounding_box()
    gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter").bounding_box()
    page.mouse.click(gutter["x"] + gutter["width"] / 2, box["y"] + box["height"] / 2)


def test_a_gutter_breakpoint_in_a_ranks_cell_stops_the_ranks_and_continue_ends_the_cell(page, lab, shots):
    from playwright.sync_api import expect

    _, _, root = lab
    (root / NOTEBOOK).write_text(json.dumps(_notebook_json([SETUP, CELL, FUNCTION, LAUNCH])))
    _open(page, lab, NOTEBOOK)
    _debugger_on(page)
    _run_cell(page, 0)
    _cell(page, 0).locator(".jp-OutputArea-output", has_text="live ranks").wait_for(timeout=120_000)

    cell = _cell(page, 1)
    _break_at(page, cell, 3)  # `y = x + 1`
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

    # A breakpoint in a function the next cell launches: each rank prints its lines, then stops there.
    _run_cell(page, 2)
    function, launch = _cell(page, 2), _cell(page, 3)
    _break_at(page, function, 5)  # `value = rank * 100 + n`
    page.locator(".jp-DebuggerBreakpoint").nth(1).wait_for(timeout=15_000)
    page.evaluate(KEEP_STOPS)
    _run_cell(page, 3)
    page.wait_for_function("() => window.nbtrainStops.length >= 2", timeout=120_000)
    names = {t["id"]: t["name"] for t in page.evaluate(THREADS)}
    stops = page.evaluate("() => window.nbtrainStops")
    assert sorted(names[s["threadId"]] for s in stops) == ["rank 0", "rank 1"], (names, stops)  # both, as threads
    shown = names[stops[-1]["threadId"]]  # the panel shows the thread that stopped last
    frame = page.locator(".jp-DebuggerCallstackFrame").first
    frame.filter(has_text="train").wait_for(timeout=60_000)
    assert "5" in frame.locator(".jp-DebuggerCallstackFrame-location").inner_text()
    rank = page.locator(".jp-DebuggerVariables-body .jp-TreeItem").filter(
        has=page.locator(".jp-DebuggerVariables-name", has_text=re.compile("^rank$")))
    expect(rank.locator(".jp-DebuggerVariables-detail")).to_have_text(shown[-1], timeout=60_000)  # that rank's own

    # Each rank's lines so far in a tab of its own, live while the ranks are paused.
    tabs = launch.locator(".nbtrain-rank-tabs")
    tabs.locator(".lm-TabBar-tab", has_text="rank 1").click()
    expect(tabs).to_contain_text("rank 1 says 5", use_inner_text=True, timeout=60_000)  # shown, not hidden
    assert "rank 0 says" not in tabs.inner_text()  # rank 0's pane is hidden behind its tab
    _snap(page, shots, "debugger-paused-in-a-launch")
    _command(page, "debugger:continue")
    launch.locator(".jp-OutputArea-output", has_text="values [6, 106]").wait_for(timeout=120_000)
    expect(launch.locator(".nbtrain-rank-tabs details")).to_have_count(2)  # the live tabs' static summary
    assert "PYDEV DEBUGGER WARNING" not in "".join(page.locator(".jp-OutputArea-output").all_inner_texts())
