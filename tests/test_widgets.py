"""The widget dashboard, the GPU picker and the choice of display.

Fast tests drive the widgets headless (ipywidgets works without a front end); the slow ones
launch real ranks from a real Jupyter kernel and inspect the widget tree left behind.
"""
import base64
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

import nbtrain
from nbtrain.common.devices import plan_devices
from nbtrain.common.inventory import Gpu, GpuProcess, NvmlInventory, StaticInventory
from nbtrain.common.protocol import BatchSize, Hello, Metric, Progress
from nbtrain.display import chart, make_display, widgets
from nbtrain.display.text import LineDisplay, QuietDisplay, summary_lines
from nbtrain.notebook.run.runmodel import RunState

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
        state.handle(Hello(rank, 100 + rank))
        state.handle(BatchSize(rank, 8, 16))
        for epoch in range(2):
            state.handle(Progress(rank, 0, "epoch", epoch, 2, False))
            state.handle(Progress(rank, 1, "batch", 0, 4, False))
            for i in range(4):
                state.handle(Progress(rank, 1, "batch", i + 1, 4, i == 3))
                state.handle(Metric(epoch * 4 + i, rank, "loss", 1 / (1 + epoch * 4 + i), True))
                state.handle(Metric(epoch * 4 + i, rank, "acc", 0.5 + 0.05 * i + 0.01 * rank, False))
        state.handle(Progress(rank, 0, "epoch", 2, 2, True))
        if rank == fail_rank:
            state.fail(rank, "ValueError: boom on rank 1\nsecond line", "Traceback ...")
        elif fail_rank is None:
            state.finish(rank, rank)
    state.ended = time.monotonic()
    return state


# -- the dashboard, headless ---------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def finished_dashboard(state: RunState, ok: bool) -> "widgets.WidgetDisplay":
    display = widgets.WidgetDisplay()
    display.start(state)
    display.finish(state, ok)
    return display


def test_dashboard_shows_every_rank_finished_then_leaves_a_summary_and_closes():
    display = widgets.WidgetDisplay()
    state = two_rank_run()
    display.output(0, "stdout", "before the dashboard")  # short commands print with no dashboard
    display.start(state)
    display.finish(state, True)
    display.output(1, "stdout", "after the dashboard")
    shown = display.snapshot()
    assert widgets.last_dashboard is display and shown["ok"] is True
    assert set(shown["ranks"]) == {0, 1}
    for row in shown["ranks"].values():
        assert row["status"] == "finished"
        assert [(b["desc"], b["value"], b["max"], b["bar_style"]) for b in row["bars"].values()] == [
            ("epoch", 2, 2, "success"), ("batch", 4, 4, "success")]
        assert "loss=0.125" in row["metrics"]
    assert "effective batch size 16 (8 per rank × 2 ranks)" in shown["header"]
    assert "finished" in display.summary and "<table>" in display.summary and "<svg" not in display.summary
    assert display.plot_png.startswith(PNG)
    assert shown["closed"]  # the widgets are gone: a saved notebook keeps only the summary


def test_a_display_started_again_draws_the_new_run_with_fresh_widgets():
    # A pool of live ranks calls one display per command: start, update, finish, start, ...
    display = widgets.WidgetDisplay()
    first, second = two_rank_run(), two_rank_run(fail_rank=1)
    display.start(first)
    display.finish(first, True)
    display.update(first)  # after finish: nothing to draw, nothing raised
    display.start(second)
    assert not display.snapshot()["closed"] and display.ok is None
    display.finish(second, False)
    assert display.snapshot()["ranks"][1]["status"] == "failed" and display.snapshot()["closed"]


def test_every_widget_model_of_a_run_is_closed_at_the_end():
    from ipywidgets.widgets.widget import _instances

    before = set(_instances)
    display = widgets.WidgetDisplay()
    state = two_rank_run()
    display.start(state)
    assert len(set(_instances) - before) > 20  # rows, bars, layouts, styles: all models in the front end
    display.finish(state, True)
    assert set(_instances) - before == set()


def test_a_dashboard_opens_few_models_sharing_layouts_and_styles():
    """Each widget, Layout and style is a front-end model (a message to open and one to close):
    widgets laid out alike share one Layout and style, and a rank's bars are made when it reports
    a loop, so a 2-rank run without one opens ~25 models, not ~100."""
    from ipywidgets.widgets.widget import _instances

    before = set(_instances)
    display = widgets.WidgetDisplay()
    state = RunState("ddp on 2 CPU ranks", [0, 1])
    for rank in (0, 1):
        state.handle(Hello(rank, 100 + rank))
    display.start(state)
    opened = len(set(_instances) - before)
    assert opened <= 30, opened
    state.handle(Progress(0, 0, "step", 1, 5, False))
    display._draw(state, time.monotonic())
    assert display.snapshot()["ranks"][0]["bars"][0]["value"] == 1  # a bar once a loop is reported
    assert len(set(_instances) - before) - opened <= 8  # one bar: 4 widgets, its style, the 3 layouts of bars
    display.finish(state, True)
    assert set(_instances) - before == set()

def test_failed_rank_turns_red_and_a_rank_it_stopped_reads_stopped_in_grey():
    state = two_rank_run(fail_rank=1)  # rank 0 never reported a result: nbtrain stopped it
    display = finished_dashboard(state, False)
    rank0, rank1 = display.snapshot()["ranks"].values()
    assert rank1["status"] == "failed"
    assert {b["bar_style"] for b in rank1["bars"].values()} == {"danger"}
    assert "ValueError: boom on rank 1" in rank1["detail"] and "second line" not in rank1["detail"]
    assert widgets.STATUS_COLOURS["failed"] in rank1["detail"]
    assert rank0["status"] == "stopped" and "stopped (rank 1 failed)" in rank0["detail"]
    assert widgets.STATUS_COLOURS["failed"] not in rank0["detail"] and widgets.NEUTRAL in rank0["detail"]
    assert {(b["bar_style"], b["bar_color"]) for b in rank0["bars"].values()} == {("", "#9e9e9e")}
    assert "stopped (rank 1 failed)" in display.summary and "ValueError: boom on rank 1" in display.summary


def test_a_stopped_ranks_own_message_is_folded():
    # The fields RunState gives a rank stopped because another failed.
    state = two_rank_run(fail_rank=1)
    view = state.ranks[0]
    view.status, view.detail = "stopped", "stopped (rank 1 failed)"
    view.reason = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
    display = finished_dashboard(state, False)
    detail = display.snapshot()["ranks"][0]["detail"]
    assert detail.index("stopped (rank 1 failed)") < detail.index("<details") < detail.index("Connection closed")
    assert widgets.STATUS_COLOURS["failed"] not in detail
    row = next(r for r in display.summary.split("<tr>") if r.startswith("<td style='text-align:left'>0<"))
    assert "stopped (rank 1 failed)" in row and "<details" in row and "Connection closed by peer" in row
    assert widgets.STATUS_COLOURS["failed"] not in row
    text = "\n".join(summary_lines(state, ok=False))
    assert "rank 0  stopped (rank 1 failed)" in text and "rank 1  failed" in text


def test_interrupted_run_reads_interrupted_and_its_ranks_stopped():
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    state.handle(Hello(0, 100))
    display = finished_dashboard(state, False)  # Ctrl-C: no rank failed, nbtrain stopped them
    shown = display.snapshot()
    assert "interrupted" in shown["header"] and "interrupted" in display.summary
    assert [row["status"] for row in shown["ranks"].values()] == ["stopped", "stopped"]
    assert display.plot_png is None  # nothing was logged: no picture


def test_redraws_are_throttled_and_skipped_when_nothing_changed(monkeypatch):
    display = widgets.WidgetDisplay()
    state = RunState("single", [0])
    display.start(state)
    draws = []
    real_draw = display._draw
    monkeypatch.setattr(display, "_draw", lambda *a, **k: (draws.append(1), real_draw(*a, **k)))
    started = time.monotonic()
    for i in range(20000):  # as fast as a training loop can report
        state.handle(Progress(0, 0, "batch", i, 20000, False))
        display.update(state)
    elapsed = time.monotonic() - started
    assert len(draws) <= elapsed / widgets.REDRAW_INTERVAL + 1
    display.vitals.interval = float("inf")  # no sample now: a sample is a change worth drawing
    display._draw(state, time.monotonic())  # caught up: what follows has nothing new
    drawn = len(draws)
    for _ in range(10000):
        display.update(state)  # same version: nothing to draw
    assert len(draws) == drawn
    display.finish(state, True)


def test_non_finite_metrics_still_draw():
    state = two_rank_run()
    for step, value in ((8, float("nan")), (9, float("inf")), (10, 0.1)):
        state.handle(Metric(step, 0, "loss", value, True))
    display = finished_dashboard(state, True)
    assert display.plot_png.startswith(PNG)
    assert "loss (mean over ranks): 1 -> 0.1" in widgets.plot_bundle(state.history)["text/plain"]


def test_summary_reads_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    display = finished_dashboard(two_rank_run(), True)
    assert display.plot_png is None and "<table>" in display.summary
    bundle = widgets.plot_bundle(two_rank_run().history)
    assert set(bundle) == {"text/plain"} and "pip install 'nbtrain[plot]'" in bundle["text/plain"]
    assert "loss (mean over ranks): 1 -> 0.125" in bundle["text/plain"]


# -- the chart -----------------------------------------------------------------------------

def test_chart_draws_synced_metrics_once_and_others_per_rank_with_axes():
    series = chart.MetricSeries()
    assert series.consume(two_rank_run().history)
    assert set(series.lines["loss"]) == {chart.MEAN} and set(series.lines["acc"]) == {0, 1}
    drawn = chart.chart_html(series)
    assert drawn.count("<svg") == 2 and drawn.count('class="nbtrain-line"') == 3
    assert "loss 0.125 (log scale)" in drawn and "acc 0.65" in drawn and "(log scale)</text>" not in drawn.split("acc")[1]
    assert "mean over ranks" in drawn and "rank 1" in drawn  # the legend
    assert ">0.5</text>" in drawn and ">0.2</text>" in drawn  # y ticks of the log axis
    assert not series.consume([])  # nothing new


def test_a_chart_of_one_mean_line_still_says_what_the_line_and_the_x_axis_are():
    from nbtrain.common.protocol import Metric

    series = chart.MetricSeries()
    series.consume([Metric(s, 0, "loss", 1 / (s + 1), True) for s in range(5)])
    legend = chart.legend_html(series, ["loss"])
    assert "mean over ranks" in legend and "x axis: step" in legend


def test_a_loss_within_one_decade_gets_more_than_one_labelled_tick():
    from nbtrain.common.protocol import Metric
    from nbtrain.display.figure import metrics_figure

    # 07 and 08 saved a log axis labelled "1" alone: the loss stayed between 0.3 and 0.9.
    fig = metrics_figure([Metric(s, 0, "loss", 0.9 - 0.04 * s, True) for s in range(15)])
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    shown = [t for t in ax.get_yticks() if low <= t <= high]
    assert ax.get_yscale() == "log" and len(shown) >= 2, shown


def test_metrics_are_drawn_in_the_order_rank_0_logged_them():
    from nbtrain.common.protocol import Metric
    from nbtrain.display.figure import lines_by_metric

    # Rank 1's messages may arrive first; the panels still follow rank 0's order.
    history = [Metric(0, 1, "acc", 0.5, False), Metric(0, 0, "loss", 2.0, True), Metric(0, 0, "acc", 0.4, False)]
    series = chart.MetricSeries()
    series.consume(history[:1])
    series.consume(history)  # the whole history each time: it reads only what is new
    assert series.names() == ["loss", "acc"] and list(lines_by_metric(history)) == ["loss", "acc"]


def test_chart_points_stay_bounded_and_keep_the_latest():
    line = chart._Line()
    for step in range(10007):
        line.add(step, float(step))
    steps, values = line.points()
    assert len(steps) <= 2 * chart.MAX_POINTS + 1 and steps[-1] == 10006 and values[0] == 0.0


def test_ticks_are_round_numbers_inside_the_range():
    assert chart.nice_ticks(0, 10) == [0, 5, 10]
    assert chart.nice_ticks(0.13, 0.91) == [0.2, 0.4, 0.6, 0.8]
    assert chart.log_ticks(1e-4, 10) == [1e-4, 1e-3, 1e-2, 0.1, 1, 10]
    assert chart.log_ticks(0.125, 1) == [0.2, 0.5, 1]
    assert chart.use_log_scale("val_loss", [2.3, 0.1]) and not chart.use_log_scale("val_loss", [0.5, -0.1])
    assert not chart.use_log_scale("acc", [0.5, 0.9])


def test_tracebacks_are_left_alone_outside_ipython():
    from nbtrain.common.tracebacks import name_cells

    text = 'Traceback (most recent call last):\n  File "/tmp/ipykernel_1/2.py", line 3, in train\n'
    assert name_cells(text) == text


# -- plots and vitals kept in the Result ---------------------------------------------------

def test_result_plot_draws_every_metric_or_the_named_ones():
    from nbtrain.notebook.run.result import Result

    result = Result.from_state(two_rank_run(), "ddp_fork", "2 CPU ranks, gloo")
    fig = result.plot()
    assert [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()] == ["loss", "acc"]
    loss = result.plot("loss").axes[0]
    assert loss.get_yscale() == "log" and [line.get_label() for line in loss.get_lines()] == ["mean over ranks"]
    acc = result.plot("acc").axes[0]
    assert acc.get_yscale() == "linear" and [line.get_label() for line in acc.get_lines()] == ["rank 0", "rank 1"]
    with pytest.raises(ValueError, match=r"no metric named 'lr' was logged; logged: \['acc', 'loss'\]"):
        result.plot("lr")


def test_result_plot_without_matplotlib_names_the_extra(monkeypatch):
    from nbtrain.notebook.run.result import Result

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'nbtrain\[plot\]'"):
        Result.from_state(two_rank_run(), "ddp_fork", "2 CPU ranks").plot("loss")


def test_step_rate_counts_the_innermost_loop_across_epochs():
    view = RunState("x", [0]).ranks[0]
    for epoch in range(3):
        view.count_steps(0, epoch, epoch, 10.0 + epoch, 10.0 + epoch)
        previous = 0
        for n in (0, 40, 100):  # the batch bar restarts every epoch
            view.count_steps(1, n, previous, 10.0 + epoch + n / 100, 10.0 + epoch + n / 100)
            previous = n
    assert view.steps == 300 and view.step_level == 1
    assert view.step_rate == pytest.approx(300 / 3.0)
    state = two_rank_run()
    assert state.ranks[0].steps == 8  # through the messages: 2 epochs x 4 batches


def test_a_resumed_loop_draws_from_initial_and_its_eta_counts_only_new_steps():
    state = RunState("x", [0])
    state.handle(Hello(0, os.getpid()))
    t0 = time.monotonic() - 2.0
    for n in range(1000, 1101, 10):  # resumed at 1000 of 2025; 100 steps over the last 2 s: 50/s
        state.handle(Progress(0, 0, "step", n, 2025, False, t0 + (n - 1000) / 50, 1000))
    display = widgets.WidgetDisplay()
    display.vitals.maybe_sample(state, now=t0 + 2.0 + state.ranks[0].lag)  # sampled as the last event came
    display.start(state)
    bar = display.snapshot()["ranks"][0]["bars"][0]
    # 925 steps left at 50/s; counting the 1000 done before would make it 550/s and 0:01.
    assert (bar["value"], bar["max"], bar["info"]) == (1100, 2025, "1100/2025  eta 0:18")
    display.finish(state, True)
    assert "step 1100/2025" in display.summary


def test_vitals_find_each_ranks_gpu_by_pid_and_memory_otherwise(monkeypatch):
    import os

    from nbtrain.common.inventory import use_inventory
    from nbtrain.display.vitals import VitalsSampler, latest, memory_text, slowest
    from nbtrain.notebook.run.result import Result

    state = RunState("ddp_fork on 2 GPUs, nccl", [0, 1])
    state.handle(Hello(0, os.getpid()))  # rank 0: this process, which "holds" GPU 1 below
    state.handle(Hello(1, 2**22 + 7))  # rank 1: a pid that is not running
    use_inventory(StaticInventory([a100(0), a100(1, GpuProcess(os.getpid(), "python", 3 * GiB), used=3 * GiB)]))
    try:
        sampler = VitalsSampler(interval=0.0)
        assert sampler.maybe_sample(state, now=100.0)
        for n in (0, 50, 100):  # each event carries the rank's clock: 100.0, 101.0, 102.0
            state.handle(Progress(0, 0, "batch", n, 1000, False, 100.0 + n / 50))
            state.handle(Progress(1, 0, "batch", n // 2, 1000, False, 100.0 + n / 50))
        assert sampler.maybe_sample(state, now=102.0)
    finally:
        use_inventory(None)
    now = latest(state)
    assert (now[0].gpu, now[0].gpu_memory, now[0].gpu_util) == (1, 3 * GiB, 90)
    assert memory_text(now[0]) == "GPU 1 3.0 GiB 90%"
    assert now[1].gpu is None and now[1].rss is None  # nothing to read for a pid that is gone
    assert (now[0].step_rate, now[1].step_rate) == (50.0, 25.0)
    assert slowest({0: now[0].step_rate, 1: now[1].step_rate}) == 1
    assert slowest({0: 50.0, 1: 48.0}) is None  # within 10%: no straggler to point at
    assert len(Result.from_state(state, "ddp_fork", "2 GPUs").vitals) == 4
    sampler = VitalsSampler()
    assert sampler.maybe_sample(state) and not sampler.maybe_sample(state)  # at most once a second
    late, sampler = RunState("x", [0, 1]), VitalsSampler()
    late.handle(Hello(0, os.getpid()))
    assert sampler.maybe_sample(late, now=1000.0) and [v.rank for v in late.vitals] == [0]
    late.handle(Hello(1, os.getpid()))  # a rank that starts later is sampled as soon as it runs
    assert sampler.maybe_sample(late, now=1000.1) and [v.rank for v in late.vitals] == [0, 1]
    assert not sampler.maybe_sample(late, now=1000.2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not NvmlInventory().physical_gpus(), reason="needs an NVIDIA GPU with its driver (NVML sees none here)")
def test_vitals_on_gpus_come_from_nvml_without_cuda_in_the_launcher():
    code = textwrap.dedent("""
        import time, torch, nbtrain
        def hold():
            ctx = nbtrain.context()
            x = torch.ones(64, 2**20, device=ctx.device)  # 256 MiB on the rank's GPU
            for _ in ctx.progress(range(30)):
                time.sleep(0.1)
            return float(x.sum())
        result = nbtrain.launch(hold, devices=1, start="fork")
        gpu = [v for v in result.vitals if v.gpu_memory]
        print(bool(gpu) and min(v.gpu_memory for v in gpu) >= 2**28, torch.cuda.is_initialized())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[-2:] == ["True", "False"]  # memory seen by NVML; no CUDA context here


def test_live_view_shows_rate_memory_and_marks_the_slowest_rank():
    import os

    display = widgets.WidgetDisplay()
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    for rank in (0, 1):
        state.handle(Hello(rank, os.getpid()))
    display.start(state)
    display.vitals.maybe_sample(state, now=0.0)
    for rank, n in ((0, 100), (1, 40)):
        for step, at in ((0, 0.0), (n // 2, 1.0), (n, 2.0)):  # at: the rank's clock
            state.handle(Progress(rank, 0, "batch", step, 1000, False, at))
    display.vitals.maybe_sample(state, now=2.0)
    display._draw(state, time.monotonic())
    rows = display.snapshot()["ranks"]
    assert rows[0]["vitals"].startswith("50 it/s · RSS ") and "slowest" not in rows[0]["vitals"]
    assert rows[1]["vitals"].startswith("20 it/s · RSS ") and "slowest" in rows[1]["vitals"]
    display.finish(state, True)


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
        assert picker.count.value == 2  # the "how many" box follows the call (it said 3)
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


def run_cell(kernel, code: str, timeout: float = 120):
    """Execute like a front end: outputs in order, display-id updates applied in place.
    Returns (outputs as [(output_type, data or text)], every output ever shown, the error)."""
    outputs, shown, error, where = [], [], None, {}

    def hook(msg):
        nonlocal error
        kind, content = msg["msg_type"], msg["content"]
        display_id = (content.get("transient") or {}).get("display_id")
        if kind in ("display_data", "execute_result"):
            if display_id:
                where.setdefault(display_id, []).append(len(outputs))
            outputs.append((kind, content["data"]))
            shown.append(content["data"])
        elif kind == "update_display_data":
            for i in where.get(display_id, []):
                outputs[i] = (outputs[i][0], content["data"])
            shown.append(content["data"])
        elif kind == "stream":
            outputs.append((content["name"], content["text"]))
        elif kind == "error":
            error = content

    kernel.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
    return outputs, shown, error


def _data(outputs) -> list[dict]:
    return [data for kind, data in outputs if isinstance(data, dict)]


def _text(outputs, stream: str) -> str:
    return "".join(text for kind, text in outputs if kind == stream)


@pytest.mark.slow
def test_kernel_run_shows_live_widgets_then_only_the_summary(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    models = kernel.value("len(__import__('ipywidgets').widgets.widget._instances)")
    outputs, shown, error = run_cell(
        kernel, 'r = nbtrain.launch(train, 4, devices=2, accelerator="cpu", start="fork", progress="widgets")')
    assert error is None, error
    assert sum(WIDGET_VIEW in data for data in shown) == 2  # during the run: the dashboard and its chart
    table, plot = _data(outputs)  # at the end: the same two outputs, replaced
    assert WIDGET_VIEW not in table and WIDGET_VIEW not in plot
    assert 'class="nbtrain-summary"' in table["text/html"] and "finished" in table["text/html"]
    assert "<svg" not in table["text/html"] and "rank 1  finished" in table["text/plain"]
    assert base64.b64decode(plot["image/png"]).startswith(PNG) and "loss (mean over ranks)" in plot["text/plain"]
    out, err = _text(outputs, "stdout"), _text(outputs, "stderr")
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 0] careful on 0" in err and "[rank 1] careful on 1" in err and "careful" not in out
    shown = kernel.value("nbtrain.display.widgets.last_dashboard.snapshot()")
    assert shown["ok"] is True and shown["closed"] and set(shown["ranks"]) == {0, 1}
    for row in shown["ranks"].values():
        assert row["status"] == "finished"
        assert [(b["value"], b["max"]) for b in row["bars"].values()] == [(2, 2), (4, 4)]
        assert "loss=0.25" in row["metrics"]
    assert "lr=0.1" in shown["ranks"][0]["metrics"] and "lr=0.2" in shown["ranks"][1]["metrics"]
    assert shown["chart"].count("<svg") == 2
    assert kernel.value("len(__import__('ipywidgets').widgets.widget._instances)") == models  # all closed
    assert kernel.value("len(r.vitals) >= 0 and r.plot('loss').axes[0].get_yscale()") == "log"


@pytest.mark.slow
def test_kernel_failed_run_blames_the_failed_rank_and_names_the_cell(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    reply = kernel.client.execute_interactive("""def slow_one():
    ctx = nbtrain.context()
    for i in ctx.progress(range(200), desc="batch"):
        time.sleep(0.01)
        if ctx.rank == 1 and i == 20:
            raise ValueError("boom on rank 1")
""", timeout=60)
    count = reply["content"]["execution_count"]  # the cell that defines `slow_one`: In[count]
    outputs, _, error = run_cell(
        kernel, 'nbtrain.launch(slow_one, devices=2, accelerator="cpu", start="fork", progress="widgets")')
    assert error is not None and error["ename"] == "WorkerError"
    shown = "\n".join(error["traceback"])
    assert f"Cell In[{count}], line 6, in slow_one" in shown and "/ipykernel_" not in shown
    table = _data(outputs)[0]
    assert "failed" in table["text/html"] and "rank 0  stopped (rank 1 failed)" in table["text/plain"]
    assert "rank 1  failed" in table["text/plain"] and "ValueError: boom on rank 1" in table["text/plain"]
    shown = kernel.value("nbtrain.display.widgets.last_dashboard.snapshot()")
    failed, stopped = shown["ranks"][1], shown["ranks"][0]
    assert shown["ok"] is False and failed["status"] == "failed" and stopped["status"] == "stopped"
    assert {b["bar_style"] for b in failed["bars"].values()} == {"danger"}
    assert "ValueError: boom on rank 1" in failed["detail"] and "stopped (rank 1 failed)" in stopped["detail"]


@pytest.mark.slow
def test_kernel_picker_shows_once_and_reads_as_text(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    outputs, _, error = run_cell(kernel, "from nbtrain.common.inventory import StaticInventory\nnbtrain.pick_gpus(StaticInventory([]))")
    assert error is None, error
    assert [kind for kind, _ in outputs] == ["display_data"]  # the widget, and no repr after it
    text = outputs[0][1]["text/plain"]
    assert text.startswith("no GPU visible") and "selected: " in text and "CPU rank" in text
    outputs, _, error = run_cell(kernel, "from nbtrain.common.inventory import StaticInventory\npicker = nbtrain.pick_gpus(StaticInventory([]))\n"
                                         "picker.cpu_ranks.value = 1\npicker")
    assert error is None and [kind for kind, _ in outputs] == ["display_data"]
    assert "selected: 1 CPU rank" in outputs[0][1]["text/plain"]  # refreshed by the last line, not repeated
    outputs, _, _ = run_cell(kernel, "picker")  # a later cell: shown again, once
    assert [kind for kind, _ in outputs] == ["display_data"] and WIDGET_VIEW in outputs[0][1]


@pytest.mark.slow
def test_kernel_text_switch_for_headless_runs(kernel):
    assert kernel.run(KERNEL_SETUP)[2] is None
    out, err, error, results = kernel.run(
        'import os; os.environ["NBTRAIN_PROGRESS"] = "text"\n'
        'try:\n'
        '    r = nbtrain.launch(train, 2, devices=2, accelerator="cpu", start="fork")\n'
        'finally:\n'
        '    del os.environ["NBTRAIN_PROGRESS"]\n'
        'print(len(r.values), "values")')
    assert error is None, error
    assert not results
    assert "nbtrain: ddp on 2 CPU ranks, gloo: finished in" in out and "2 values" in out
    assert kernel.value("[t.name for t in __import__('threading').enumerate() if t.name.startswith('nbtrain')]") == []


# -- saved notebooks -----------------------------------------------------------------------

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_notebooks_are_small_and_hold_no_widgets(path):
    # A widget saved in a notebook reads "Error displaying widget: model not found" once its
    # kernel is gone; finished runs leave static summaries instead.
    text = path.read_text()
    assert len(text.encode()) < 60_000, f"{path.name}: {len(text.encode())} bytes"
    assert "application/vnd.jupyter.widget-state+json" not in text
    assert WIDGET_VIEW not in text
