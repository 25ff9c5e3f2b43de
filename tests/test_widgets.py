"""The widget dashboard, the GPU picker and the choice of display.

Fast tests drive the widgets headless (ipywidgets works without a front end); the slow ones
launch real ranks from a real Jupyter kernel and inspect the widget tree left behind.
"""
import sys
import threading
import time
import types

import pytest

import nbtrain
from nbtrain import Gpu, GpuProcess, StaticInventory
from nbtrain.devices import plan_devices
from nbtrain.display import chart, make_display, widgets
from nbtrain.display.text import LineDisplay, QuietDisplay
from nbtrain.runstate import RunState

GiB = 2**30
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def a100(i: int, *processes: GpuProcess, used: int = 0) -> Gpu:
    return Gpu(i, "NVIDIA A100-SXM4-80GB", f"GPU-{i:08d}", f"0000:{i + 1:02x}:00.0", used, 80 * GiB,
               90 if processes else 0, processes, (8, 0))


def four_gpus(busy: int | None = None) -> StaticInventory:
    """Four A100s; GPU `busy` has someone else's process on it."""
    return StaticInventory([a100(i, GpuProcess(4242, "python", 5 * GiB), used=5 * GiB) if i == busy else a100(i)
                            for i in range(4)])


def two_rank_run(fail_rank: int | None = None) -> RunState:
    """A RunState as two ranks of 2 epochs x 4 batches would leave it."""
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    for rank in (0, 1):
        state.handle(("hello", rank, 100 + rank))
        state.handle(("batch_size", rank, 8, 16))
        for epoch in range(2):
            state.handle(("progress", rank, 0, "epoch", epoch, 2, False))
            state.handle(("progress", rank, 1, "batch", 0, 4, False))
            for i in range(4):
                state.handle(("progress", rank, 1, "batch", i + 1, 4, i == 3))
                state.handle(("metric", rank, epoch * 4 + i, "loss", 1 / (1 + epoch * 4 + i), True))
                state.handle(("metric", rank, epoch * 4 + i, "acc", 0.5 + 0.05 * i + 0.01 * rank, False))
        state.handle(("progress", rank, 0, "epoch", 2, 2, True))
        if rank == fail_rank:
            state.fail(rank, "ValueError: boom on rank 1\nsecond line", "Traceback ...")
        elif fail_rank is None:
            state.handle(("value", rank, rank))
    state.ended = time.monotonic()
    return state


# -- the dashboard, headless ---------------------------------------------------------------

def test_dashboard_shows_every_rank_finished_with_full_bars():
    display = widgets.WidgetDisplay()
    state = two_rank_run()
    display.start(state)
    display.finish(state, True)
    shown = display.snapshot()
    assert widgets.last_dashboard is display and shown["ok"] is True
    assert set(shown["ranks"]) == {0, 1}
    for row in shown["ranks"].values():
        assert row["status"] == "finished"
        assert [(b["desc"], b["value"], b["max"], b["bar_style"]) for b in row["bars"].values()] == [
            ("epoch", 2, 2, "success"), ("batch", 4, 4, "success")]
        assert "loss=0.125" in row["metrics"]
    assert "effective batch size 16 (8 per rank × 2 ranks)" in shown["header"]
    assert "finished" in display.summary and "<table>" in display.summary


def test_failed_rank_turns_red_and_says_why():
    display = widgets.WidgetDisplay()
    state = two_rank_run(fail_rank=1)
    display.start(state)
    display.finish(state, False)
    rank0, rank1 = display.snapshot()["ranks"].values()
    assert rank1["status"] == "failed"
    assert {b["bar_style"] for b in rank1["bars"].values()} == {"danger"}
    assert "ValueError: boom on rank 1" in rank1["detail"] and "second line" not in rank1["detail"]
    assert rank0["status"] == "stopped"  # never reported a result: nbtrain stopped it
    assert "failed" in display.summary and "ValueError: boom on rank 1" in display.summary


def test_interrupted_run_reads_stopped():
    display = widgets.WidgetDisplay()
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    state.handle(("hello", 0, 100))
    display.start(state)
    display.finish(state, False)  # Ctrl-C: no rank failed, nbtrain stopped them
    shown = display.snapshot()
    assert "stopped" in shown["header"] and "stopped" in display.summary
    assert [row["status"] for row in shown["ranks"].values()] == ["stopped", "stopped"]


def test_redraws_are_throttled_and_skipped_when_nothing_changed(monkeypatch):
    display = widgets.WidgetDisplay()
    state = RunState("single", [0])
    display.start(state)
    draws = []
    real_draw = display._draw
    monkeypatch.setattr(display, "_draw", lambda *a, **k: (draws.append(1), real_draw(*a, **k)))
    started = time.monotonic()
    for i in range(20000):  # as fast as a training loop can report
        state.handle(("progress", 0, 0, "batch", i, 20000, False))
        display.update(state)
    elapsed = time.monotonic() - started
    assert len(draws) <= elapsed / widgets.REDRAW_INTERVAL + 1
    display._draw(state, time.monotonic())  # caught up: what follows has nothing new
    drawn = len(draws)
    started = time.perf_counter()
    for _ in range(10000):
        display.update(state)  # same version: nothing to draw
    assert len(draws) == drawn
    assert time.perf_counter() - started < 0.25  # microseconds each: fine inside a training loop


def test_chart_draws_synced_metrics_once_and_others_per_rank():
    series = chart.MetricSeries()
    assert series.consume(two_rank_run().history)
    assert set(series.lines["loss"]) == {0} and set(series.lines["acc"]) == {0, 1}
    svg = chart.chart_html(series)
    assert svg.count("<svg") == 2 and svg.count("<polyline") == 3
    assert not series.consume([])  # nothing new


def test_chart_points_stay_bounded_and_keep_the_latest():
    line = chart._Line()
    for step in range(10007):
        line.add(step, float(step))
    steps, values = line.points()
    assert len(steps) <= 2 * chart.MAX_POINTS + 1 and steps[-1] == 10006 and values[0] == 0.0


# -- choosing a display --------------------------------------------------------------------

@pytest.mark.parametrize("progress, env, expected", [
    (False, None, QuietDisplay), (True, "0", QuietDisplay), ("text", None, LineDisplay),
    (True, "text", LineDisplay), ("widgets", None, widgets.WidgetDisplay), (True, "widgets", widgets.WidgetDisplay),
    ("widgets", "text", widgets.WidgetDisplay),  # the argument wins over the default from the environment
])
def test_progress_argument_and_environment_choose_the_display(monkeypatch, progress, env, expected):
    if env is None:
        monkeypatch.delenv("NBTRAIN_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("NBTRAIN_PROGRESS", env)
    assert type(make_display(progress)) is expected


def test_unknown_progress_value_says_what_is_accepted(monkeypatch):
    with pytest.raises(ValueError, match=r"progress='fancy'.*'widgets', 'text'"):
        make_display("fancy")
    monkeypatch.setenv("NBTRAIN_PROGRESS", "txt")
    with pytest.raises(ValueError, match="NBTRAIN_PROGRESS='txt'"):
        make_display(True)


def test_missing_ipywidgets_falls_back_to_text_with_one_message(monkeypatch, capsys):
    import nbtrain.display as display_module

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails as if not installed
    monkeypatch.setattr(display_module, "_warned_widgets", False)
    first, second = make_display("widgets"), make_display("widgets")
    assert type(first) is type(second) is LineDisplay
    out = capsys.readouterr().out
    assert out.count("pip install 'ipywidgets>=8'") == 1
    with pytest.raises(ImportError, match="pip install"):
        nbtrain.pick_gpus(four_gpus())


def test_colab_widget_manager_is_enabled_once(monkeypatch):
    calls = []
    output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(1))
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    monkeypatch.setattr(widgets, "_front_end_ready", False)
    widgets.WidgetDisplay()
    nbtrain.pick_gpus(StaticInventory([]), refresh=None).close()
    widgets.WidgetDisplay()
    assert calls == [1]


# -- the GPU picker ------------------------------------------------------------------------

def test_picker_selection_is_the_devices_launch_uses():
    inventory = four_gpus()
    picker = nbtrain.pick_gpus(inventory, refresh=None)
    try:
        assert picker.devices == [0, 1, 2, 3]  # free GPUs start selected
        picker.select([0, 2])
        assert picker.devices == [0, 2]
        picker._rows["GPU-00000003"].check.value = True  # a click in the front end
        assert picker.devices == [0, 2, 3] and "selected: [0, 2, 3]" in picker.message.value
        plan = plan_devices(picker, inventory=inventory)
        assert plan.accelerator == "gpu" and plan.indices == (0, 2, 3)
        with pytest.raises(ValueError, match="GPU 7 is not visible"):
            picker.select([7])
    finally:
        picker.close()


def test_auto_select_skips_the_busy_gpu():
    picker = nbtrain.pick_gpus(four_gpus(busy=1), refresh=None)
    try:
        picker.select([])
        assert picker.auto_select() == [0, 2, 3]
        assert picker.auto_select(2) == [0, 2]
        assert picker.auto_select(4) == [0, 2]  # only 3 free: selection kept, reason shown
        assert "3 of 4 visible are free" in picker.message.value and "pid 4242" in picker.message.value
        picker.count.value = 1  # the count box and the button, as in the front end
        assert picker.devices == [0, 2]
        picker.auto.click()
        assert picker.devices == [0]
    finally:
        picker.close()


def test_picker_rows_show_memory_utilisation_processes_and_remapping(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    picker = nbtrain.pick_gpus(StaticInventory([a100(i, GpuProcess(7, "trainer", GiB), used=GiB) if i == 3
                                                else a100(i) for i in range(4)]), refresh=None)
    try:
        rows = [picker._rows[uuid] for uuid in ("GPU-00000002", "GPU-00000003")]
        assert [r.check.description for r in rows] == ["GPU 0 (phys 2)", "GPU 1 (phys 3)"]
        assert "1.0/80.0 GiB" in rows[1].memory.value and rows[1].util.value == "90%"
        assert "7 trainer" in rows[1].processes.value
        assert picker.devices == [0] and "CUDA_VISIBLE_DEVICES=2,3" in picker.header.value
    finally:
        picker.close()


def test_refresh_thread_follows_the_inventory_and_stops_on_close():
    inventory = four_gpus()
    before = set(threading.enumerate())
    picker = nbtrain.pick_gpus(inventory, refresh=0.05)
    started = set(threading.enumerate()) - before
    assert [t.name for t in started] == ["nbtrain-gpu-picker"]
    inventory.gpus[2] = a100(2, GpuProcess(999, "someone", 2 * GiB), used=2 * GiB)
    deadline = time.monotonic() + 5
    while "999 someone" not in picker._rows["GPU-00000002"].processes.value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "999 someone" in picker._rows["GPU-00000002"].processes.value
    assert picker.devices == [0, 1, 2, 3]  # a refresh never changes the selection
    assert "GPU 2 is in use by pid 999" in picker.message.value
    picker.close()
    assert not [t for t in started if t.is_alive()]
    assert picker.devices == [0, 1, 2, 3]  # still answers after close


def test_closing_the_widget_stops_the_thread():
    picker = nbtrain.pick_gpus(four_gpus(), refresh=0.05)
    thread = picker._thread
    picker.widget.close()  # as when the front end closes it
    thread.join(2)
    assert not thread.is_alive()


def test_no_gpu_offers_cpu_ranks():
    picker = nbtrain.pick_gpus(StaticInventory([]))
    try:
        assert picker._thread is None  # nothing to refresh
        assert "No GPU visible" in picker.header.value
        assert picker.devices == picker.cpu_ranks.value == min(2, picker.cpu_ranks.max)
        picker.cpu_ranks.value = 1
        plan = plan_devices(picker, inventory=StaticInventory([]))
        assert plan.accelerator == "cpu" and plan.nprocs == 1
    finally:
        picker.close()


def test_gpu_table_html_has_memory_bars():
    html = nbtrain.gpus(four_gpus(busy=1))._repr_html_()
    assert html.count("<tr>") == 5 and "width:6%" in html and "5.0/80.0 GiB" in html


# -- in a real kernel ----------------------------------------------------------------------

KERNEL_SETUP = """
import sys, time
import nbtrain, nbtrain.display.widgets

def train(n, fail_rank=None):
    ctx = nbtrain.context()
    print(f"hello from {ctx.rank}")
    print(f"careful on {ctx.rank}", file=sys.stderr)
    for epoch in ctx.progress(range(2), desc="epoch"):
        for i in ctx.progress(range(n), desc="batch"):
            ctx.log("loss", 1.0 / (1 + i), sync_dist=True)
            ctx.log("lr", 0.1 * (ctx.rank + 1))
            if ctx.rank == fail_rank and epoch == 1 and i == 2:
                raise ValueError(f"boom on rank {ctx.rank}")
    return ctx.rank
"""


def _mimetypes(results) -> set:
    return {m for bundle in results for m in bundle}


def _html(results) -> str:
    return "".join(bundle.get("text/html", "") for bundle in results)


@pytest.mark.slow
def test_kernel_run_draws_the_dashboard_and_a_summary(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    out, err, error, results = kernel.run(
        'r = nbtrain.launch(train, 4, devices=2, accelerator="cpu", strategy="ddp_fork", progress="widgets")')
    assert error is None, error
    assert WIDGET_VIEW in _mimetypes(results)
    assert 'class="nbtrain-summary"' in _html(results) and "finished" in _html(results)
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 0] careful on 0" in err and "[rank 1] careful on 1" in err and "careful" not in out
    shown = kernel.value("nbtrain.display.widgets.last_dashboard.snapshot()")
    assert shown["ok"] is True and set(shown["ranks"]) == {0, 1}
    for row in shown["ranks"].values():
        assert row["status"] == "finished"
        assert [(b["value"], b["max"]) for b in row["bars"].values()] == [(2, 2), (4, 4)]
        assert "loss=0.25" in row["metrics"]
    assert "lr=0.1" in shown["ranks"][0]["metrics"] and "lr=0.2" in shown["ranks"][1]["metrics"]
    assert shown["chart"].count("<svg") == 2


@pytest.mark.slow
def test_kernel_failed_run_leaves_a_red_bar(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    out, err, error, results = kernel.run(
        'nbtrain.launch(train, 4, fail_rank=1, devices=2, accelerator="cpu", strategy="ddp_fork", progress="widgets")')
    assert error is not None and error["ename"] == "WorkerError"
    assert WIDGET_VIEW in _mimetypes(results) and "failed" in _html(results)
    shown = kernel.value("nbtrain.display.widgets.last_dashboard.snapshot()")
    failed = shown["ranks"][1]
    assert shown["ok"] is False and failed["status"] == "failed"
    assert {b["bar_style"] for b in failed["bars"].values()} == {"danger"}
    assert "ValueError: boom on rank 1" in failed["detail"]
    assert failed["bars"][1]["value"] < 4 or failed["bars"][0]["value"] < 2


@pytest.mark.slow
def test_kernel_picker_and_text_switch(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    out, err, error, results = kernel.run("picker = nbtrain.pick_gpus(nbtrain.StaticInventory([]))")
    assert error is None, error
    assert WIDGET_VIEW in _mimetypes(results)
    # Headless executions (nbval, nbconvert) ask for text through the environment.
    out, err, error, results = kernel.run(
        'import os; os.environ["NBTRAIN_PROGRESS"] = "text"\n'
        'try:\n'
        '    r = nbtrain.launch(train, 2, devices=picker, accelerator="cpu", strategy="ddp_fork")\n'
        'finally:\n'
        '    del os.environ["NBTRAIN_PROGRESS"]\n'
        'print(len(r.values), "values")')
    assert error is None, error
    assert WIDGET_VIEW not in _mimetypes(results)
    assert "nbtrain: ddp_fork on 2 CPU ranks, gloo: finished in" in out and "2 values" in out
    assert kernel.value("picker.close() or [t.name for t in __import__('threading').enumerate() "
                        "if t.name.startswith('nbtrain')]") == []
