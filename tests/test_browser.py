"""What a person sees: JupyterLab in headless Chromium, driven by Playwright.

A JupyterLab server (random port, token, a temporary root) runs a notebook written here: a
run that finishes, the GPU picker, a run that fails. The tests read the page's DOM during
and after the runs, after saving, closing and reopening, and in an untrusted copy. Their
screenshots are kept under pytest's temporary directory; the path is printed.

Chromium is Debian's (`apt-get install chromium`), passed to Playwright as its executable:
`playwright install` needs the network and is not needed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = [name for name, found in (("chromium (apt-get install chromium)", CHROMIUM),
                                    ("playwright (pip install playwright)", importlib.util.find_spec("playwright")),
                                    ("jupyterlab (pip install jupyterlab)", importlib.util.find_spec("jupyterlab")))
           if not found]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")]

NOTEBOOK = "dashboard.ipynb"
SETUP = '''\
import time
import nbtrain
from nbtrain.common.inventory import Gpu, StaticInventory

def train(epochs=2, batches=40):
    ctx = nbtrain.context()
    for epoch in ctx.progress(range(epochs), desc="epoch"):
        for i in ctx.progress(range(batches), desc="batch"):
            time.sleep(0.12)
            step = epoch * batches + i
            ctx.log("loss", 2.0 / (1 + step), sync_dist=True)
            ctx.log("acc", 1 - 0.5 / (1 + step) - 0.02 * ctx.rank)
    return ctx.rank

def fails():
    ctx = nbtrain.context()
    for i in ctx.progress(range(100), desc="batch"):
        time.sleep(0.05)
        ctx.log("loss", 1.0 / (1 + i))
        if ctx.rank == 1 and i == 20:
            raise ValueError("rank 1 gives up")
'''
RUN = 'result = nbtrain.launch(train, devices=2, accelerator="cpu", start="fork")'
PICKER = ('gpus = [Gpu(i, "NVIDIA A100-SXM4-80GB", f"GPU-{i}", f"0000:0{i + 1}:00.0", 0, 80 * 2**30, 0) for i in range(4)]\n'
          'picker = nbtrain.pick_gpus(StaticInventory(gpus), refresh=None)')
FAIL = 'nbtrain.launch(fails, devices=2, accelerator="cpu", start="fork")'
CHECK = 'print("devices", picker.devices)'
CELLS = [SETUP, RUN, PICKER, FAIL, CHECK]  # run-all stops at FAIL's error; CHECK runs after a click


def _notebook_json(cells: list[str]) -> dict:
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {},
                       "outputs": [], "source": source} for i, source in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server in a temporary root; yields (base url, token, root)."""
    root = tmp_path_factory.mktemp("lab")
    private = tmp_path_factory.mktemp("jupyter")  # runtime, data and settings: nothing shared is touched
    settings = private / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    (root / NOTEBOOK).write_text(json.dumps(_notebook_json(CELLS)))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**{k: v for k, v in os.environ.items() if k != "NBTRAIN_PROGRESS"},
           "JUPYTER_RUNTIME_DIR": str(private / "runtime"), "JUPYTER_DATA_DIR": str(private / "data"),
           "JUPYTERLAB_SETTINGS_DIR": str(private / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(private / "workspaces")}
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: run-all, save, close as commands
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    log = open(private / "server.log", "w")
    server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log = (private / 'server.log').read_text()[-3000:]
                    raise RuntimeError(f"JupyterLab did not start:\n{log}") from None
                time.sleep(0.5)
        yield url, token, root
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down; their ranks die with them
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Where the screenshots go (kept after the run, like pytest's other temporary files)."""
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def page(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


def _open(page, lab, name: str) -> None:
    url, token, _ = lab
    page.goto(f"{url}/lab/tree/{name}?token={token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.context"
                           f" && window.jupyterapp.shell.currentWidget.context.path === {name!r}"  # not the tab before
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                           timeout=90_000)


def _command(page, name: str) -> None:
    # Not awaited: run-all's promise resolves only when every cell has run.
    page.evaluate(f"() => {{ window.jupyterapp.commands.execute({name!r}); }}")


def _notebook(page):
    return page.locator(".jp-Notebook:visible")  # the open tab's (a reopened one may sit behind it)


def _cell(page, i: int):
    return _notebook(page).locator(".jp-Cell").nth(i)


def _widgets_gone(cell) -> None:
    """The cell's widgets were all replaced (summary, then plot: two messages, drawn one by one)."""
    from playwright.sync_api import expect

    expect(cell.locator(".jupyter-widgets")).to_have_count(0, timeout=30_000)


def _bar_widths(cell) -> list[tuple[float, ...]]:
    """Per rank row: the width (%) of each of its progress bars, outermost first."""
    return cell.locator(".nbtrain-rank").evaluate_all(
        "rows => rows.map(r => Array.from(r.querySelectorAll('.progress-bar'))"
        ".map(b => parseFloat(b.style.width) || 0))")


def _snap(page, shots, name: str) -> None:
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)


def _print_where(capsys, shots) -> None:
    with capsys.disabled():
        print(f"\nscreenshots: {shots}")


def test_live_dashboard_then_static_summary_picker_and_failure(page, lab, shots, capsys):
    _open(page, lab, NOTEBOOK)
    _command(page, "notebook:run-all-cells")
    run = _cell(page, 1)
    run.locator(".nbtrain-rank .progress-bar").first.wait_for(timeout=60_000)
    deadline = time.monotonic() + 30
    while not all(any(w) for w in _bar_widths(run)) and time.monotonic() < deadline:
        time.sleep(0.2)  # both ranks report their first steps
    first = _bar_widths(run)
    run.locator(".nbtrain-chart polyline.nbtrain-line").first.wait_for(timeout=30_000)
    time.sleep(2.5)
    _snap(page, shots, "1-mid-run")
    later = _bar_widths(run)
    assert len(first) == len(later) == 2, (first, later)
    assert all(tuple(b) > tuple(a) for a, b in zip(first, later)), f"bars did not advance: {first} -> {later}"
    points = run.locator(".nbtrain-chart polyline.nbtrain-line").first.get_attribute("points")
    assert len(points.split()) >= 2, points
    assert run.locator(".nbtrain-rank").first.inner_text().count("it/s") == 1  # the rank's step rate

    fail = _cell(page, 3)
    fail.locator(".jp-OutputArea-output", has_text="rank 1 failed:").wait_for(timeout=120_000)
    _snap(page, shots, "2-after-run-all")

    # The finished run: only the static summary, its table and its picture.
    _widgets_gone(run)
    assert run.locator(".nbtrain-summary table tr").count() == 3
    assert "finished" in run.locator(".nbtrain-summary").inner_text()
    image = run.locator(".jp-RenderedImage img")
    assert image.count() == 1 and image.evaluate("img => img.naturalWidth") > 200
    assert run.locator(".jp-OutputArea-output svg").count() == 0  # inline SVG would not survive an untrusted reopen

    # The failed run names rank 1; rank 0, stopped because of it, reads stopped.
    summary = fail.locator(".nbtrain-summary").inner_text()
    rows = {line.split("\t")[0]: line for line in summary.splitlines() if line[:1].isdigit()}
    assert "failed" in rows["1"] and "rank 1 gives up" in rows["1"]
    assert "stopped (rank 1 failed)" in rows["0"] and "failed\t" not in rows["0"]
    assert "rank 1 failed: ValueError: rank 1 gives up" in fail.locator(".jp-OutputArea-output").last.inner_text()
    _widgets_gone(fail)
    fail.scroll_into_view_if_needed()
    _snap(page, shots, "3-failed-run")

    # The picker is an input: a click changes picker.devices in the kernel.
    picker = _cell(page, 2)
    box = picker.locator(".widget-checkbox", has_text="GPU 2").locator("input")
    assert box.is_checked()
    box.click()
    check = _cell(page, 4)
    check.click()
    _command(page, "notebook:run-cell")
    check.locator(".jp-OutputArea-output").wait_for(timeout=30_000)
    assert check.locator(".jp-OutputArea-output").inner_text().strip() == "devices [0, 1, 3]"
    assert "selected: [0, 1, 3]" in picker.inner_text()
    picker.scroll_into_view_if_needed()
    _snap(page, shots, "4-picker")
    _print_where(capsys, shots)


def test_saved_closed_and_reopened_notebook_shows_no_widget_errors(page, lab, shots, capsys):
    _, _, root = lab
    _command(page, "docmanager:save")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
    _command(page, "application:close")
    _notebook(page).wait_for(state="detached", timeout=30_000)
    saved = json.loads((root / NOTEBOOK).read_text())
    widget_outputs = [i for i, cell in enumerate(saved["cells"]) for out in cell.get("outputs", [])
                      if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert widget_outputs == [2]  # the picker only: finished runs left their summaries
    assert "application/vnd.jupyter.widget-state+json" not in json.dumps(saved)

    _open(page, lab, NOTEBOOK)
    _notebook(page).locator(".nbtrain-summary").first.wait_for(state="attached", timeout=30_000)
    page.locator(".widget-checkbox").first.wait_for(timeout=30_000)  # the picker, from the running kernel
    time.sleep(1)
    _snap(page, shots, "5-reopened")
    text = _notebook(page).inner_text()
    assert "Error displaying widget" not in text and "model not found" not in text
    assert page.locator(".jp-RenderedImage img").count() == 2


def test_untrusted_copy_without_a_kernel_shows_the_summaries(page, lab, shots, capsys):
    # As a reader gets it: a notebook someone else saved, not trusted here, kernel not running
    # the code that made its outputs.
    _, _, root = lab
    saved = json.loads((root / NOTEBOOK).read_text())
    saved["cells"] = [cell for i, cell in enumerate(saved["cells"]) if i in (0, 1, 3)]
    saved["metadata"]["copied"] = True  # another notebook: its signature is unknown here
    (root / "copy.ipynb").write_text(json.dumps(saved))
    _open(page, lab, "copy.ipynb")
    _notebook(page).locator(".nbtrain-summary").first.wait_for(state="attached", timeout=30_000)
    time.sleep(1)
    _snap(page, shots, "6-untrusted-copy")
    notebook = _notebook(page)
    assert not page.evaluate("() => window.jupyterapp.shell.currentWidget.content.model.cells.get(1).trusted")
    text = notebook.inner_text()
    assert "Error displaying widget" not in text and "model not found" not in text
    assert notebook.locator(".nbtrain-summary table").count() == 2
    images = notebook.locator(".jp-RenderedImage img")
    assert images.count() == 2 and all(images.nth(i).evaluate("img => img.naturalWidth") > 200 for i in range(2))
    assert re.search(r"stopped \(rank 1 failed\)", text)
    _print_where(capsys, shots)


LIVE_NOTEBOOK = "live_ranks.ipynb"
LIVE_CELLS = [
    "%load_ext nbtrain\nimport nbtrain",
    "%nbtrain start --devices 2 --accelerator cpu",
    "%%ranks\nprint(f'hello from rank {ctx.rank}')\nx = 10 * ctx.rank\nx",
    "%%ranks\nimport time\nfor i in ctx.progress(range(40), desc='step'):\n    time.sleep(0.05)\n    ctx.log('loss', 1 / (1 + i))",
    "%%ranks\nprint('sleeping')\ntime.sleep(120)",
    "%%ranks\nx + 1",
]


def test_live_ranks_cells_their_output_a_dashboard_and_the_interrupt_button(page, lab, shots, capsys):
    _, _, root = lab
    (root / LIVE_NOTEBOOK).write_text(json.dumps(_notebook_json(LIVE_CELLS)))
    _open(page, lab, LIVE_NOTEBOOK)
    _command(page, "notebook:run-all-cells")

    hello, train, sleeper = _cell(page, 2), _cell(page, 3), _cell(page, 4)
    hello.locator(".jp-OutputArea-output", has_text="[rank 1] 10").wait_for(timeout=120_000)
    said = hello.locator(".jp-OutputArea").inner_text()
    assert "[rank 0] hello from rank 0" in said and "[rank 1] hello from rank 1" in said, said
    assert "[rank 0] 0" in said  # each rank's last value, in this cell and no other

    # The cell that reports progress got a dashboard, replaced by its summary when it ended.
    train.locator(".nbtrain-summary").wait_for(timeout=60_000)
    _widgets_gone(train)
    assert "finished" in train.locator(".nbtrain-summary").inner_text()

    # The toolbar's interrupt reaches the ranks; their state is kept for the next cell.
    sleeper.locator(".jp-OutputArea-output", has_text="[rank 1] sleeping").wait_for(timeout=60_000)
    time.sleep(1)  # the ranks are in time.sleep
    page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']:visible").click()
    sleeper.locator(".jp-OutputArea-output", has_text="KeyboardInterrupt").first.wait_for(timeout=30_000)
    shown = sleeper.locator(".jp-OutputArea").inner_text()
    assert "the live ranks [0, 1] were interrupted; their state is kept." in shown and "Cell In[5], line 2" in shown
    assert "supervisor" not in shown  # where the ranks were, not nbtrain's own frames
    sleeper.scroll_into_view_if_needed()
    _snap(page, shots, "7-live-ranks")
    # Run-all stopped at the interrupted cell; the last cell runs on the same, live ranks.
    last = _cell(page, 5)
    last.click()
    _command(page, "notebook:run-cell")
    last.locator(".jp-OutputArea-output", has_text="[rank 1] 11").wait_for(timeout=60_000)
    assert "[rank 0] 1" in last.locator(".jp-OutputArea").inner_text()
    assert "Error displaying widget" not in _notebook(page).inner_text()
    _print_where(capsys, shots)
