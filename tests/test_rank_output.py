"""A rank's notebook output in a real Jupyter kernel, for every local placement: rich display and its
updates from rank 0 in the cell (other ranks' shown at the end, one selector per rank), a tqdm bar as one live line per rank, and
log records tagged with their rank."""
import re

import pytest

pytestmark = pytest.mark.slow

SETUP = '''
%load_ext nbtrain
import logging, time, nbtrain
from IPython.display import display, HTML
from tqdm.auto import tqdm          # in the kernel: the notebook (widget) bar
from rich.progress import track     # rich, imported in the kernel: it believes it is in Jupyter
logging.basicConfig(level=logging.INFO)   # a handler that holds the kernel's own stderr

def shows(steps=50):
    ctx = nbtrain.context()
    handle = display(HTML(f"<b>table from rank {ctx.rank}</b>"), display_id=True)
    handle.update(HTML(f"<b>rank {ctx.rank} updated its table</b>"))
    for _ in tqdm(range(steps), desc=f"bar{ctx.rank}", mininterval=0, miniters=1):
        time.sleep(0.002)
    logging.warning("a record from the rank")
    return ctx.rank
'''

CELL = '''%%nbtrain --start torchrun --devices 2 --accelerator cpu --no-progress
import logging, time
from IPython.display import display, HTML
from tqdm.auto import tqdm
ctx = nbtrain.context()
handle = display(HTML(f"<b>table from rank {ctx.rank}</b>"), display_id=True)
handle.update(HTML(f"<b>rank {ctx.rank} updated its table</b>"))
for _ in tqdm(range(50), desc=f"bar{ctx.rank}", mininterval=0, miniters=1):
    time.sleep(0.002)
logging.warning("a record from the rank")
'''

ESCAPE = re.compile("\x1b")
NOT_COLOUR = re.compile(r"\x1b(?!\[[0-9;]*m)")  # an escape that is no colour (SGR)


class Output:
    """Every message a cell sent to the front end, in order."""

    def __init__(self, kernel, code: str, timeout: float = 240):
        self.messages = []
        kernel.client.execute_interactive(code, timeout=timeout,
                                          output_hook=lambda m: self.messages.append((m["msg_type"], m["content"])))
        errors = [c for t, c in self.messages if t == "error"]
        assert not errors, "\n".join(errors[0]["traceback"])

    def of(self, kind: str) -> list[dict]:
        return [c for t, c in self.messages if t == kind]

    @property
    def text(self) -> str:
        return "".join(c["text"] for c in self.of("stream"))

    def outputs_with(self, word: str) -> int:
        """How many outputs the cell keeps that mention `word`: stream lines and displays (not updates)."""
        lines = sum(word in line for line in self.text.splitlines())
        shown = sum(any(word in str(v) for v in c["data"].values()) for c in self.of("display_data"))
        return lines + shown


@pytest.fixture(scope="module")
def nb(kernel):
    out = Output(kernel, SETUP)
    assert not out.of("error")
    return kernel


def summaries(out: Output) -> list[str]:
    """The ranks' tabs as the cell keeps them: a `<details>` per rank, shown at the end or put in
    place of the live tabs."""
    return [c["data"]["text/html"] for c in out.of("display_data") + out.of("update_display_data")
            if "nbtrain-rank-tabs" in c["data"].get("text/html", "")]


def live_panes(out: Output) -> dict[str, list[str]]:
    """What each tab of the live view held, update by update, by its title (`rank 1`)."""
    tabs, children, titles, values = set(), [], [], {}
    for kind, content in out.messages:
        state = content.get("data", {}).get("state", {}) if kind in ("comm_open", "comm_msg") else {}
        if state.get("_model_name") == "TabModel":
            tabs.add(content["comm_id"])
        if content.get("comm_id") in tabs:
            children = [c.removeprefix("IPY_MODEL_") for c in state.get("children", [])] or children
            titles = state.get("titles") or titles
        if "value" in state:
            values.setdefault(content["comm_id"], []).append(state["value"])
    return {title: values.get(child, []) for title, child in zip(titles, children)}


def check(out: Output) -> None:
    html = [c for c in out.of("display_data") if "text/html" in c["data"]]
    tabs = summaries(out)
    html = [c for c in html if "nbtrain-rank-tabs" not in c["data"]["text/html"]]
    assert [c["data"]["text/html"] for c in html] == ["<b>table from rank 0</b>"]
    # rank 1's, at the end, in its own selector, as it last drew it, beside its lines
    assert len(tabs) == 1 and "<div><b>rank 1 updated its table</b></div>" in tabs[0], tabs
    rank_1 = tabs[0][tabs[0].index("<summary>rank 1 ("):]
    assert "a record from the rank" in rank_1 and "50/50" in rank_1 and "table from rank 0" not in tabs[0]
    display_id = html[0]["transient"]["display_id"]
    updates = [c for c in out.of("update_display_data") if "text/html" in c["data"] and c["data"]["text/html"] not in tabs]
    assert [(c["data"]["text/html"], c["transient"]["display_id"]) for c in updates] == [
        ("<b>rank 0 updated its table</b>", display_id)]
    assert "rank 1 displayed 1 rich output" in out.text  # not shown, but said

    for rank in (0, 1):  # 50 redraws: one output per rank, updated in place, ending at 50/50
        assert out.outputs_with(f"bar{rank}") == 1, out.text
        drawn = [c["data"]["text/plain"] for c in out.of("display_data") + out.of("update_display_data")
                 if f"bar{rank}" in c["data"].get("text/plain", "")]
        assert drawn and all(d.startswith(f"[rank {rank}] bar{rank}") for d in drawn)
        assert "50/50" in drawn[-1]
        assert f"[rank {rank}] WARNING:root:a record from the rank" in out.text or \
            f"[rank {rank}] a record from the rank" in out.text
    everything = out.text + "".join(str(c["data"]) for c in out.of("display_data") + out.of("update_display_data"))
    assert "\r" not in everything and not ESCAPE.search(everything)
    assert "<IPython.core.display.HTML object>" not in out.text  # printed instead of shown


@pytest.mark.parametrize("start", ["fork", "template", "spawn"])
def test_launch_shows_rank_output_as_the_notebook_would(nb, start):
    out = Output(nb, f"r = nbtrain.launch(shows, devices=2, accelerator='cpu', start={start!r}, progress=False)")
    check(out)


def test_torchrun_cell_shows_rank_output_as_the_notebook_would(nb):
    check(Output(nb, CELL))


def test_clear_output_from_rank_zero_clears_the_cell_and_keeps_the_dashboard(nb):
    out = Output(nb, '''
def frames():
    from IPython.display import clear_output
    for i in range(3):
        clear_output(wait=True)
        display(HTML(f"<i>frame {i} of rank {nbtrain.context().rank}</i>"))
    return 1
r = nbtrain.launch(frames, devices=2, accelerator="cpu", start="fork", progress="widgets")
''')
    clears = out.of("clear_output")
    assert len(clears) == 3 and all(c["wait"] for c in clears)
    frames = [c["data"]["text/html"] for c in out.of("display_data") if "<i>" in c["data"].get("text/html", "")]
    assert frames == [f"<i>frame {i} of rank 0</i>" for i in range(3)]
    # rank 1's selector, at the end, holds what it showed after its last clear
    tabs = summaries(out)
    assert len(tabs) == 1 and "<summary>rank 1 (1 output)</summary><div><i>frame 2 of rank 1</i></div>" in tabs[0]
    # After each clear the dashboard is shown again, under its own id: the summary replaces it at the end.
    dashboard = [c for c in out.of("display_data") if "nbtrain-dashboard" in str(c["data"]) or
                 "replaced by a summary" in c["data"].get("text/plain", "")]
    ids = {c["transient"]["display_id"] for c in dashboard}
    assert len(dashboard) == 4 and len(ids) == 1
    summary = [c for c in out.of("update_display_data") if c["transient"]["display_id"] in ids]
    assert summary and "nbtrain-summary" in summary[-1]["data"]["text/html"]


@pytest.mark.parametrize("start", ["fork", "template"])
def test_a_rich_progress_bar_is_one_live_line_per_rank(nb, start):
    out = Output(nb, f"""
def tracks():
    rank = nbtrain.context().rank
    for _ in track(range(30), description=f"rich{{rank}}", refresh_per_second=50):
        time.sleep(0.005)
    print("after the bar")
r = nbtrain.launch(tracks, devices=2, accelerator="cpu", start={start!r}, progress=False)
""")
    drawn = [c for c in out.of("display_data") + out.of("update_display_data")  # the ranks' tabs are the kernel's
             if not c["data"].get("text/plain", "").startswith("nbtrain: each rank's output")]
    for rank in (0, 1):
        assert out.outputs_with(f"rich{rank}") == 1, out.text
        last = [c["data"]["text/plain"] for c in drawn if f"rich{rank}" in c["data"].get("text/plain", "")][-1]
        assert last.startswith(f"[rank {rank}] rich{rank}") and "100%" in last
        assert f"[rank {rank}] after the bar" in out.text
    everything = out.text + "".join(str(c["data"]) for c in drawn)
    assert "\r" not in everything and not NOT_COLOUR.search(everything)
    assert "widget-view" not in everything  # no ipywidgets from another process


def test_live_ranks_show_rich_output_and_bars_in_the_cell_that_ran_them(nb):
    Output(nb, "%nbtrain start --devices 2 --accelerator cpu")
    try:
        out = Output(nb, """%%ranks
handle = display(HTML(f"<b>table from rank {ctx.rank}</b>"), display_id=True)
handle.update(HTML(f"<b>rank {ctx.rank} updated its table</b>"))
for _ in tqdm(range(50), desc=f"bar{ctx.rank}", mininterval=0, miniters=1):
    time.sleep(0.01)
logging.warning("a record from the rank")
print(f"first line of rank {ctx.rank}")
time.sleep(0.6)
print(f"second line of rank {ctx.rank}")
""")
        check(out)
        panes = live_panes(out)  # each rank's tab, as the cell ran: its own lines, before the next came
        for rank in (0, 1):
            assert any(f"first line of rank {rank}" in v and "second" not in v for v in panes[f"rank {rank}"]), panes
            assert f"rank {1 - rank}" not in "".join(panes[f"rank {rank}"])
            assert f"second line of rank {rank}" in summaries(out)[0]
        assert any("bar1" in v and "50/50" not in v for v in panes["rank 1"])  # its bar, while it drew
        later = Output(nb, "%%ranks --rank 1\ndisplay(HTML('<b>only rank 1 ran this</b>'))")
        assert [c["data"]["text/html"] for c in later.of("display_data")] == ["<b>only rank 1 ran this</b>"]
    finally:
        Output(nb, "%nbtrain stop")


RANK_WITHOUT_A_SHELL = '''
import io, json, logging, queue, sys, threading
from nbtrain.common.channel import Hub
from nbtrain.common.channel_link import Link
from nbtrain.rank.output import show_in_notebook

inbox = queue.Queue()
hub = Hub(inbox)
hub.start()
link = Link(3, hub.environ)
show_in_notebook(link, 3)
before = "IPython" in sys.modules

from IPython.display import HTML, clear_output, display   # the rank's code imports IPython
handle = display(HTML("<b>hi</b>"), display_id="table")
handle.update(HTML("<b>bye</b>"))
display({"text/plain": "odd", "application/x-odd": threading.Lock()}, raw=True)  # cannot travel whole
clear_output(wait=True)

from tqdm.notebook import tqdm as notebook_tqdm
bar_file = io.StringIO()
for _ in notebook_tqdm(range(3), file=bar_file, mininterval=0):
    pass
import rich.console
console = rich.console.Console()

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger().addHandler(handler)
logging.warning("hello")
link.close()
hub.close()
messages = []
while not inbox.empty():
    messages.append(inbox.get())
print(json.dumps({"imported_before": before, "messages": [[m.kind, *m] for m in messages if m.kind != "closed"],
                  "bar": bar_file.getvalue(), "rich": [console.is_jupyter, console.is_terminal],
                  "record_rank": records[0].rank}))
'''


def test_a_rank_without_a_shell_gets_one_when_it_imports_ipython():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RANK_WITHOUT_A_SHELL], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["imported_before"] is False  # nbtrain itself never imports IPython in a rank
    messages = [tuple(m) for m in seen["messages"]]
    assert messages[0] == ("display", 3, {"text/plain": "<IPython.core.display.HTML object>", "text/html": "<b>hi</b>"},
                           {}, {"display_id": "table"})
    assert messages[1] == ("update_display", 3, {"text/plain": "<IPython.core.display.HTML object>",
                                                 "text/html": "<b>bye</b>"}, {}, {"display_id": "table"})
    assert messages[2] == ("display", 3, {"text/plain": "odd"}, {}, {})
    assert messages[3] == ("clear_output", 3, True)
    assert "3/3" in seen["bar"] and "\r" in seen["bar"]  # tqdm's notebook bar drew text
    assert seen["rich"] == [False, True]  # rich: no Jupyter, a terminal on the rank's own streams
    assert seen["record_rank"] == 3
