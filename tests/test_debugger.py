"""JupyterLab's debugger on live ranks, at the protocol level: the Debug Adapter Protocol requests
JupyterLab sends (`debug_request` on the control channel) and the events it reads (`debug_event`
on IOPub), with a real kernel, 2 CPU ranks (gloo) and debugpy in the kernel, as in the browser."""
import itertools
import queue
import re
import time

import pytest

from conftest import Kernel

pytestmark = pytest.mark.slow

SETUP = '''
%load_ext nbtrain
import nbtrain
ranks = nbtrain.Ranks(devices=2, accelerator="cpu")
'''

CELL = '''%%ranks
import torch
x = ctx.rank * 10 + 7
w = torch.zeros(2, 3)
y = x + 1
print("done", y)
'''
BREAK_LINE = 5  # `y = x + 1`: line 1 is the magic


class Panel:
    """What JupyterLab's debugger panel does, over jupyter_client: requests and their replies on
    the control channel, events from IOPub (other IOPub messages are kept for the cell's output)."""

    def __init__(self, kernel: Kernel):
        self.kernel, self.client, self.seq = kernel, kernel.client, itertools.count(1)
        self.events: list[dict] = []
        self.output: list[str] = []

    def ask(self, command: str, timeout: float = 60, **arguments) -> dict:
        content = {"seq": next(self.seq), "type": "request", "command": command, "arguments": arguments}
        msg = self.client.session.msg("debug_request", content)
        self.client.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.control_channel.get_msg(timeout=max(deadline - time.monotonic(), 0.01))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def ok(self, command: str, **arguments) -> dict:
        reply = self.ask(command, **arguments)
        assert reply.get("success"), (command, reply)
        return reply.get("body", {})

    def read_iopub(self, until, timeout: float = 120) -> None:
        """Read IOPub until `until()` holds (events noted, printed text kept)."""
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, f"not seen within {timeout:g} s; events: {self.events}, output: {self.output}"
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])
            elif msg["msg_type"] == "stream":
                self.output.append(msg["content"]["text"])

    def run(self, code: str, timeout: float = 120) -> dict:
        """Execute a cell to its end; its reply's content."""
        cell = self.client.execute(code)
        while (reply := self.client.get_shell_msg(timeout=timeout))["parent_header"].get("msg_id") != cell:
            pass
        return reply["content"]

    def value(self, expression: str):
        return self.kernel.value(expression)

    def stopped(self) -> set[int]:
        return {e["body"]["threadId"] for e in self.events if e.get("event") == "stopped"}

    def local(self, thread: int, name: str) -> str:
        """`name`'s value in the top frame of `thread`, as the variables panel reads it."""
        frames = self.ok("stackTrace", threadId=thread)["stackFrames"]
        scopes = self.ok("scopes", frameId=frames[0]["id"])["scopes"]
        locals_ = next(s for s in scopes if s["name"] == "Locals")
        variables = self.ok("variables", variablesReference=locals_["variablesReference"])["variables"]
        return next(v for v in variables if v["name"] == name)["value"]


@pytest.fixture(scope="module")
def panel():
    kernel = Kernel()
    try:
        out, err, error, _ = kernel.run("%load_ext nbtrain")
        assert error is None, (out, err, error)
        panel = Panel(kernel)  # the debugger on first, as JupyterLab's toggle: the ranks are forks of a debugged kernel
        panel.ok("initialize", clientID="test", adapterID="python", pathFormat="path", linesStartAt1=True,
                 columnsStartAt1=True, supportsVariableType=True, supportsVariablePaging=True,
                 supportsRunInTerminalRequest=True, locale="en")
        panel.ok("attach")
        panel.ok("configurationDone")
        out, err, error, _ = kernel.run(SETUP)
        assert error is None, (out, err, error)
        yield panel
    finally:
        kernel.close()


def test_a_breakpoint_in_a_ranks_cell_stops_every_rank_and_each_shows_its_own_values(panel):
    path = panel.ok("dumpCell", code=CELL)["sourcePath"]
    set_ = panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": BREAK_LINE}],
                    sourceModified=False)
    assert [b["line"] for b in set_["breakpoints"]] == [BREAK_LINE]
    cell = panel.client.execute(CELL)
    panel.read_iopub(lambda: len(panel.stopped()) == 2)

    threads = {t["name"]: t["id"] for t in panel.ok("threads")["threads"]}
    assert {"rank 0", "rank 1"} <= set(threads), threads
    assert panel.stopped() == {threads["rank 0"], threads["rank 1"]}

    frame = panel.ok("stackTrace", threadId=threads["rank 1"])["stackFrames"][0]
    assert (frame["source"]["path"], frame["line"]) == (path, BREAK_LINE)
    assert panel.local(threads["rank 1"], "x") == "17"
    assert panel.local(threads["rank 0"], "x") == "7"
    assert panel.local(threads["rank 1"], "w") == "tensor(shape=(2, 3), dtype=torch.float32, device=cpu)"
    assert "y" not in panel.ok("evaluate", expression="dir()", frameId=frame["id"], context="watch")["result"]
    assert panel.ok("evaluate", expression="x * 2", frameId=frame["id"], context="watch")["result"] == "34"
    info = panel.ok("debugInfo")
    assert {threads["rank 0"], threads["rank 1"]} <= set(info["stoppedThreads"])

    panel.ok("next", threadId=threads["rank 1"])  # every paused rank steps over `y = x + 1`
    panel.read_iopub(lambda: sum(e.get("event") == "stopped" for e in panel.events) == 4)
    assert panel.local(threads["rank 1"], "y") == "18"
    assert panel.local(threads["rank 0"], "y") == "8"

    panel.ok("continue", threadId=threads["rank 0"])  # both go on; the cell ends
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    assert reply["content"]["status"] == "ok", reply["content"]
    panel.read_iopub(lambda: "done 18" in "".join(panel.output) and "done 8" in "".join(panel.output))
    assert panel.ask("stackTrace", threadId=threads["rank 1"])["success"] is False  # running again

    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)
    stops = len(panel.stopped())
    assert panel.run(CELL)["status"] == "ok"  # no breakpoint left: the cell runs through
    assert len(panel.stopped()) == stops


def test_debugpy_in_the_kernel_does_not_take_over_its_forks(panel):
    """debugpy, as ipykernel starts it, patches os.fork so each child dials it as a debuggee of its
    own (a forked rank hung there); nbtrain asks that off: the ranks have their own debugger."""
    assert panel.value("__import__('os').fork.__module__") == "posix"
    assert panel.value("ranks.eval('__import__(\"sys\").gettrace()')") == [None, None]


FUNCTION = '''def train(scale):
    rank = nbtrain.context().rank
    value = rank * scale + 1
    return value
'''


@pytest.mark.parametrize("start", ["template", "torchrun"])
def test_a_breakpoint_in_a_launched_function_stops_its_ranks(panel, start):
    """Ranks of the warm template and torchrun's read the breakpoints from their environment
    before their first command, as spawned and a cluster's ranks do (forked ones inherit them;
    the live ranks here are forked)."""
    path = panel.ok("dumpCell", code=FUNCTION)["sourcePath"]
    assert panel.run(FUNCTION)["status"] == "ok"
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}], sourceModified=False)
    seen = len(panel.events)
    cell = panel.client.execute(f'result = nbtrain.launch(train, 5, devices=2, accelerator="cpu", start="{start}")')

    def stops():
        return {e["body"]["threadId"] for e in panel.events[seen:] if e.get("event") == "stopped"}

    panel.read_iopub(lambda: len(stops()) == 2)
    threads = panel.ok("threads")["threads"]
    launched = {t["name"]: t["id"] for t in threads if t["id"] in stops()}
    assert set(launched) == {"rank 0", "rank 1"}, (threads, stops())
    frame = panel.ok("stackTrace", threadId=launched["rank 1"])["stackFrames"][0]
    assert (frame["name"], frame["source"]["path"], frame["line"]) == ("train", path, 3)
    assert panel.local(launched["rank 1"], "rank") == "1"
    panel.ok("continue", threadId=1)  # as JupyterLab's panel sends it, whichever thread stopped
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    assert reply["content"]["status"] == "ok", reply["content"]
    assert panel.value("result.values") == [1, 6]
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)


NBTRAIN_CELL = "%%nbtrain --devices 1 --accelerator cpu\nz = 41\nz += 1\n"


def test_a_breakpoint_in_a_percent_nbtrain_cell_is_said_not_to_stop_it(panel):
    """Its body runs as code of its own: the cell says so in one line, and runs (never waits on a stop)."""
    path = panel.ok("dumpCell", code=NBTRAIN_CELL)["sourcePath"]
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}], sourceModified=False)
    try:
        out, err, error, _ = panel.kernel.run(NBTRAIN_CELL)
        assert error is None, (out, err, error)
        assert out.count("the breakpoints in this %%nbtrain cell do not stop its ranks") == 1, out
    finally:
        panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)
    out, err, error, _ = panel.kernel.run(NBTRAIN_CELL)  # none set: nothing said
    assert error is None and "do not stop" not in out, (out, err, error)


KERNEL_CELL = '''a = 20
b = a + 1
print("kernel", b)
'''


def test_the_kernels_own_breakpoints_keep_working(panel):
    path = panel.ok("dumpCell", code=KERNEL_CELL)["sourcePath"]
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}], sourceModified=False)
    ranks = {t["id"] for t in panel.ok("threads")["threads"] if t["name"].startswith("rank ")}
    seen = len(panel.events)
    cell = panel.client.execute(KERNEL_CELL)
    panel.read_iopub(lambda: any(e.get("event") == "stopped" for e in panel.events[seen:]))
    thread = next(e for e in panel.events[seen:] if e.get("event") == "stopped")["body"]["threadId"]
    assert thread not in ranks
    frame = panel.ok("stackTrace", threadId=thread)["stackFrames"][0]
    assert (frame["source"]["path"], frame["line"]) == (path, 2)
    panel.ok("continue", threadId=thread)
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    assert reply["content"]["status"] == "ok"
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)


def test_an_interrupt_ends_a_paused_cell_and_the_ranks_serve_on(panel):
    cell_code = CELL.replace("done", "interrupted")
    path = panel.ok("dumpCell", code=cell_code)["sourcePath"]
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": BREAK_LINE}], sourceModified=False)
    seen = len(panel.events)
    cell = panel.client.execute(cell_code)

    def events(kind):
        return [e for e in panel.events[seen:] if e.get("event") == kind]

    panel.read_iopub(lambda: len(events("stopped")) == 2)
    panel.kernel.manager.interrupt_kernel()
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    assert reply["content"]["status"] == "error" and "KeyboardInterrupt" in "".join(reply["content"]["traceback"])
    panel.read_iopub(lambda: len(events("continued")) == 2)  # the panel hears that they run again
    assert not panel.ok("debugInfo")["stoppedThreads"]
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)
    assert panel.run("%%ranks\nctx.rank")["status"] == "ok"
    assert "interrupted" not in "".join(panel.output)


FAILING = '''%%ranks
def step(batch):
    scale = 10 + ctx.rank
    if ctx.rank == 1:
        raise ValueError(f"bad batch {batch}")
    return batch * scale
step(3)
'''


def test_percent_debug_opens_a_failed_ranks_frame_in_the_panel(panel):
    out, err, error, _ = panel.kernel.run(FAILING)
    assert error is not None and error["ename"] == "WorkerError", (out, err, error)
    seen = len(panel.events)
    assert panel.run("%debug")["status"] == "ok"  # the stopped event may come before the cell ends: read below
    panel.read_iopub(lambda: any(e.get("event") == "stopped" for e in panel.events[seen:])
                     and "rank 1's failure is open in the debugger panel" in "".join(panel.output))
    stopped = next(e for e in panel.events[seen:] if e.get("event") == "stopped")["body"]
    assert stopped["reason"] == "exception" and stopped["description"] == "rank 1"
    frame = panel.ok("stackTrace", threadId=stopped["threadId"])["stackFrames"][0]
    assert (frame["name"], frame["line"]) == ("step", 5)
    assert panel.local(stopped["threadId"], "scale") == "11"
    assert panel.ok("evaluate", expression="batch + 1", frameId=frame["id"], context="watch")["result"] == "4"
    panel.ok("continue", threadId=1)  # as JupyterLab's panel sends it: closes the post-mortem
    panel.read_iopub(lambda: any(e.get("event") == "continued" for e in panel.events[seen:]))
    assert panel.run("%%ranks\nctx.rank")["status"] == "ok"  # the ranks serve on


STALLS = '''import time
import torch
import torch.distributed as dist

def stalls(nap):
    ctx = nbtrain.context()
    ctx.barrier()
    t = torch.ones(3) * (ctx.rank + 1)
    if ctx.rank == 1:
        time.sleep(nap)  # the stuck rank: rank 0 waits for it in all_reduce
    dist.all_reduce(t)
'''


def test_a_launch_stuck_past_its_timeout_is_kept_for_debug_until_a_cell_that_does_not_debug_it(panel):
    """#56's post-mortem on the stalled rank itself: text pdb at rank 0's frames while it still
    waits in gloo's all_reduce, the panel at rank 1's (asleep); a later cell ends them."""
    assert panel.run(STALLS)["status"] == "ok"
    before = {t["id"] for t in panel.ok("threads")["threads"]}
    cell = panel.client.execute(
        'nbtrain.launch(stalls, 600, devices=2, accelerator="cpu", start="fork", progress=False, timeout=5, stall=False)')
    deadline = time.monotonic() + 60
    while True:  # pause the launch's rank 0 (stuck, in gloo's all_reduce) until it is there: its frames as they are
        assert time.monotonic() < deadline, panel.output
        rank_0 = next((t["id"] for t in panel.ok("threads")["threads"] if t["name"] == "rank 0" and t["id"] not in before),
                      None)
        seen = len(panel.events)
        if rank_0 is None or not panel.ask("pause", threadId=rank_0).get("success"):
            time.sleep(0.1)  # not started yet
            continue
        panel.read_iopub(lambda seen=seen: any(e.get("event") == "stopped" for e in panel.events[seen:]))
        frame = panel.ok("stackTrace", threadId=rank_0)["stackFrames"][0]
        if (frame["name"], frame["line"]) == ("stalls", 11):  # in all_reduce, from the user's line
            break
        panel.ok("continue", threadId=rank_0)
        time.sleep(0.1)
    assert panel.local(rank_0, "t") == "tensor(shape=(3,), dtype=torch.float32, device=cpu)"
    panel.ok("continue", threadId=rank_0)
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    error = reply["content"]
    assert error["ename"] == "WorkerError", error
    assert "Ranks [1, 0] are kept where they wait until a cell that does not debug them ends: %debug opens rank " \
           "1's frames" in "\n".join(error["traceback"]), error
    out, err, error, _ = panel.kernel.run(
        "import sys, os\n"
        "from nbtrain.notebook.run import stalled\n"
        "pids = [p.pid for kept in stalled._kept.values() for p in kept.pool.processes]\n"
        "sys.last_value.debug(0, commands=['where', 'p t', 'next', 'q'])")
    assert error is None, (out, err, error)
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert out.startswith("> Cell In[") and re.search(r"-> (11 +)?dist\.all_reduce\(t\)", out), out
    assert "tensor([1., 1., 1.])" in out, out
    assert "rank 0's code is stuck here: nothing can run in these frames" in out, out
    seen = len(panel.events)
    assert panel.run("%debug")["status"] == "ok"  # the panel is on: rank 1, the one blamed, opens there
    panel.read_iopub(lambda: any(e.get("event") == "stopped" for e in panel.events[seen:]))
    stopped = next(e for e in panel.events[seen:] if e.get("event") == "stopped")["body"]
    assert (stopped["reason"], stopped["description"]) == ("pause", "rank 1")
    frame = panel.ok("stackTrace", threadId=stopped["threadId"])["stackFrames"][0]
    assert (frame["name"], frame["line"]) == ("stalls", 10)
    assert panel.local(stopped["threadId"], "nap") == "600"
    # A cell that does not debug them (this one): they are stopped as it ends, and the panel told.
    assert panel.value("[pid for pid in pids if os.path.exists(f'/proc/{pid}')], stalled._kept") == ([], {})
    assert stopped["threadId"] not in panel.ok("debugInfo")["stoppedThreads"]


LOOPING = '''%%ranks
import time
print("looping", flush=True)
i = 0
while i < 2000:
    time.sleep(0.05)
    i += 1
'''


def test_a_breakpoint_set_while_a_cell_runs_stops_its_ranks(panel):
    """The ranks run untraced (no breakpoint when the cell began); the one set now reaches them:
    each rank's main thread arms its tracer where it is, and stops at the line."""
    path = panel.ok("dumpCell", code=LOOPING)["sourcePath"]
    seen, said = len(panel.events), len(panel.output)
    cell = panel.client.execute(LOOPING)
    panel.read_iopub(lambda: "".join(panel.output[said:]).count("looping") == 2)
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 7}], sourceModified=False)
    stops = lambda: {e["body"]["threadId"] for e in panel.events[seen:] if e.get("event") == "stopped"}  # noqa: E731
    panel.read_iopub(lambda: len(stops()) == 2)
    for thread in stops():
        frame = panel.ok("stackTrace", threadId=thread)["stackFrames"][0]
        assert (frame["source"]["path"], frame["line"]) == (path, 7)
        assert int(panel.local(thread, "i")) < 2000  # stopped in the loop, as it ran
        panel.ok("evaluate", expression="i = 2000", frameId=frame["id"], context="repl")  # the loop's end
    panel.ok("setBreakpoints", source={"path": path}, breakpoints=[], sourceModified=False)
    panel.ok("continue", threadId=1)
    while (reply := panel.client.get_shell_msg(timeout=120))["parent_header"].get("msg_id") != cell:
        pass
    assert reply["content"]["status"] == "ok", reply["content"]
