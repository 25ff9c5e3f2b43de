"""Steering a run in the background (`launch(wait=False)`): every rank applies each change at the same step."""
import os
import re
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

import nbtrain
from conftest import CHILDREN, running
from nbtrain.common import protocol, runlog
from nbtrain.common.errors import WorkerError
from nbtrain.display import chart
from nbtrain.display.chart import MetricSeries, chart_html
from nbtrain.display.figure import metrics_figure
from nbtrain.notebook.detached import exported_job
from nbtrain.notebook.run.background import WATCHING
from nbtrain.notebook.run.steer import SteerError
from nbtrain.rank.context import Context
from nbtrain.rank.steer import Steering

LR, NEW_LR = 0.05, 0.01


def train(steps=1_000_000, sleep=0.002):
    """A tiny DDP model that trains until stopped; each step logs the lr it used."""
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ctx.steer(model=model, optimizer=opt)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])
    for step in ctx.progress(range(steps)):
        # Each rank its own batch: parameters stay equal only through DDP's averaged gradients.
        rows = slice((step * 8 + ctx.rank * 4) % 64, (step * 8 + ctx.rank * 4) % 64 + 4)
        loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("lr", opt.param_groups[0]["lr"])
        time.sleep(sleep * (1 + ctx.rank))  # ranks at different speeds: the agreement is needed
    return model


@pytest.fixture
def background(no_leftovers):
    """`launch(wait=False)`, whose runs a failed test leaves are cancelled before `no_leftovers` looks."""
    runs = []

    def launch(*args, **kwargs):
        runs.append(nbtrain.launch(*args, wait=False, progress=False, **kwargs))
        return runs[-1]

    yield launch
    for run in runs:
        run.cancel()


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def started(run, timeout=120):
    """The run once every rank has passed a step boundary or two (it has begun training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = run._state()
        if state is not None and all(1 in v.bars and v.bars[1].n > 2 or 0 in v.bars and v.bars[0].n > 2 for v in state.ranks.values()):
            return run
        assert not run.done(), run.result()
        time.sleep(0.05)
    raise AssertionError("the ranks did not begin training")


CASES = [pytest.param("fork", 2, id="fork"), pytest.param("template", 2, id="template"),
         pytest.param("fork", 4, id="fork-4"), pytest.param("spawn", 2, id="spawn")]


@pytest.mark.slow
@pytest.mark.parametrize("start,ranks", CASES)
def test_every_rank_applies_each_change_at_the_same_step(start, ranks, background):
    run = background(train, devices=ranks, accelerator="cpu", start=start)
    assert not run.done()
    started(run)
    step = run.pause()
    assert run.pause() == step, "paused already: the same step"
    assert run.metrics("lr") and set(run.metrics("lr", None)) == {LR}  # what was logged so far
    before = run.call(parameters)
    assert len(before) == ranks
    for other in before[1:]:
        assert all(torch.equal(a, b) for a, b in zip(before[0], other))
    run.set(lr=NEW_LR)
    assert run.call(lambda optimizer, step: (step, optimizer.param_groups[0]["lr"])) == [(step, NEW_LR)] * ranks
    run.resume()
    time.sleep(0.5)
    stopped = run.stop()
    assert stopped >= step
    result = run.result(timeout=120)
    assert run.done()
    assert [(c.step, c.what) for c in result.changes] == [(step, "pause"), (step, "call"), (step, "set"),
                                                           (step, "call"), (step, "resume"), (stopped, "stop")]
    for rank in range(ranks):
        lrs = result.metrics("lr", rank)
        # The steps before the agreed one used the old lr, every step after it the new one, and none was run after the stop.
        assert lrs == [LR] * step + [NEW_LR] * (stopped - step), f"rank {rank}"
    models = result.values
    for model in models[1:]:  # DDP replicas did not diverge
        assert all(torch.equal(a, b) for a, b in zip(parameters(models[0]), parameters(model)))


@pytest.mark.slow
def test_live_ranks_run_in_the_background_steered_as_a_launch_and_stay(no_leftovers):
    with nbtrain.Ranks(devices=2, accelerator="cpu", start="fork", progress=False) as ranks:
        run = started(ranks.run(train, wait=False, progress=False))
        with pytest.raises(RuntimeError, match="run a function in the background"):
            ranks.eval("1")  # one command at a time
        step = run.pause()
        run.set(lr=NEW_LR)
        run.resume()
        time.sleep(0.3)
        stopped = run.stop()
        result = run.result(timeout=60)
        assert [c.what for c in result.changes] == ["pause", "set", "resume", "stop"]
        for rank in (0, 1):
            assert result.metrics("lr", rank) == [LR] * step + [NEW_LR] * (stopped - step), f"rank {rank}"
        assert ranks.eval("1 + 1") == [2, 2]  # the next command
        run = started(ranks.run(train, wait=False, progress=False))
        assert run.cancel()  # the ranks' Ctrl-C: they stay, ready for the next command
        with pytest.raises(CancelledError):
            run.result()
        assert ranks.eval("2") == [2, 2]
        run = ranks.run(train, wait=False, progress=False)
    assert run.done()  # closing the ranks cancelled it first
    with pytest.raises(CancelledError):
        run.result()


def train_alone(steps=1_000_000):
    """Ranks without a collective, rank 1 ten times slower: each is at its own step when asked to hold."""
    ctx = nbtrain.context()
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=LR)
    ctx.steer(optimizer=opt)
    for _ in ctx.progress(range(steps)):
        ctx.log("lr", opt.param_groups[0]["lr"])
        time.sleep(0.002 if ctx.rank == 0 else 0.02)


@pytest.mark.slow
def test_ranks_at_different_steps_hold_at_the_furthest(background):
    run = started(background(train_alone, devices=2, accelerator="cpu", start="fork"))
    time.sleep(0.5)  # rank 0 is far ahead by now
    step = run.pause()
    assert step > 2
    assert run.call(lambda step: step) == [step, step]
    run.set(lr=NEW_LR)
    stopped = run.stop()
    result = run.result(timeout=60)
    for rank in (0, 1):
        assert result.metrics("lr", rank) == [LR] * step + [NEW_LR] * (stopped - step), f"rank {rank}"


@pytest.mark.slow
def test_a_pause_right_after_the_launch_holds_at_the_first_step(background):
    run = background(train, devices=2, accelerator="cpu", start="spawn")  # slow to start: still starting now
    assert run.pause(timeout=120) == 1
    assert run.call(lambda step: step) == [1, 1]
    assert run.stop() == 1
    assert run.result(timeout=60).metrics("lr") == [LR]


@pytest.mark.slow
def test_pause_without_a_step_boundary_says_where_the_ranks_are(background):
    def no_progress():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # no ctx.progress, no ctx.step: nothing to hold at
            time.sleep(0.05)

    run = background(no_progress, devices=2, accelerator="cpu", start="fork")
    with pytest.raises(TimeoutError) as caught:
        run.pause(timeout=2)
    said = str(caught.value)
    assert "did not reach a step boundary within 2 s" in said
    assert "ranks [0, 1]" in said and "time.sleep(0.05)" in said, said  # where each rank is
    assert not run.done(), "the run goes on"
    pids = [v.pid for v in run._pool.state.ranks.values()]
    assert run.cancel()
    with pytest.raises(CancelledError):
        run.result()
    assert not any(running(pid) for pid in pids)


@pytest.mark.slow
def test_a_rank_that_dies_while_paused_fails_the_run_as_when_running(background):
    run = started(background(train, devices=2, accelerator="cpu", start="fork"))
    run.pause()
    with pytest.raises(WorkerError) as caught:
        run.call(lambda ctx: os._exit(3) if ctx.rank == 1 else None)
    assert "rank 1" in str(caught.value)
    with pytest.raises(WorkerError):
        run.result(timeout=60)


@pytest.mark.slow
def test_a_timeout_while_paused_ends_the_run_as_when_running(background):
    run = started(background(train, devices=2, accelerator="cpu", start="fork", timeout=15))
    run.pause()
    with pytest.raises(WorkerError) as caught:
        run.result(timeout=120)
    assert "timed out after 15 s" in str(caught.value)
    with pytest.raises(WorkerError):
        run.pause()  # the run's error, not a wait


@pytest.mark.slow
def test_a_failing_call_keeps_the_ranks_held_and_the_run_goes_on(background):
    run = started(background(train, devices=2, accelerator="cpu", start="fork"))
    step = run.pause()
    with pytest.raises(SteerError, match=r"ZeroDivisionError.*on ranks \[0, 1\]"):
        run.call(lambda step: 1 / 0)
    with pytest.raises(SteerError, match="no 'betas'"):
        run.set(betas=(0.9, 0.99))  # SGD has none
    assert run.call(lambda step: step) == [step, step]
    run.stop()
    assert run.result(timeout=60).changes[-1].what == "stop"


@pytest.mark.slow
def test_a_checkpoint_at_the_agreed_step_loads_back(background, tmp_path):
    def load(path):
        ctx = nbtrain.context()
        model = ctx.setup(torch.nn.Linear(4, 1))
        loaded = ctx.load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), step=0)
        return loaded["step"], parameters(model)

    run = started(background(train, devices=2, accelerator="cpu", start="fork"))
    step = run.pause()
    held = run.call(parameters)[0]
    run.checkpoint(tmp_path / "ckpt")
    run.stop()
    assert [c.what for c in run.result(timeout=60).changes] == ["pause", "call", "checkpoint", "stop"]
    for loaded_step, loaded in nbtrain.launch(load, tmp_path / "ckpt", devices=2, accelerator="cpu", start="fork",
                                              progress=False).values:
        assert loaded_step == step and all(torch.equal(a, b) for a, b in zip(held, loaded))


@pytest.mark.slow
def test_wait_true_is_unchanged_and_ctx_step_stops_a_loop_of_ones_own(background):
    def own_loop():
        ctx = nbtrain.context()
        ctx.steer(state={"n": 0})
        n = 0
        while not ctx.step():
            n += 1
            time.sleep(0.005)
            if n > 100_000:
                break
        return n

    assert nbtrain.launch(train, 5, devices=2, accelerator="cpu", start="fork", progress=False).metrics("lr") == [LR] * 5
    run = background(own_loop, devices=2, accelerator="cpu", start="fork")
    time.sleep(1)
    step = run.stop()
    assert run.result(timeout=60).values == [step - 1, step - 1]  # stopped at ctx.step()'s boundary `step`


@pytest.mark.slow
def test_a_submitted_run_is_steered_from_its_run_object(tmp_path, no_leftovers):
    run = nbtrain.submit(train, devices=2, accelerator="cpu", run_dir=tmp_path / "run", progress=False)
    try:
        deadline = time.monotonic() + 120
        while not (run.dir / "steer").is_dir():  # the supervisor serves steering once its ranks started
            assert time.monotonic() < deadline and run.status not in ("failed", "finished"), run.status
            time.sleep(0.1)
        step = nbtrain.attach(run.dir).pause(timeout=120)  # from any kernel: a Run read back from the directory
        run.set(lr=NEW_LR)
        assert run.call(lambda step: step) == [step, step]
        run.resume()
        time.sleep(0.1)  # a few steps with the new lr
        stopped = run.stop()
        result = run.result(timeout=120)
    finally:
        if run.status not in ("finished", "failed", "cancelled"):
            run.cancel()
    assert [(c.step, c.what) for c in result.changes] == [(step, "pause"), (step, "set"), (step, "call"),
                                                           (step, "resume"), (stopped, "stop")]
    # The changes are run events in its log: a kernel that attaches later reads them (and marks the chart).
    logged = [e for _, e in runlog.Tail(run.dir / runlog.EVENTS).read() if isinstance(e, protocol.Change)]
    assert logged == result.changes
    for rank in (0, 1):
        assert result.metrics("lr", rank) == [LR] * step + [NEW_LR] * (stopped - step), f"rank {rank}"
    # Its export makes the set and the stop again at their steps (and job.py lists every change).
    job = run.export(tmp_path / "job")
    assert f"#   step {step}: set lr={NEW_LR}\n" in (job / "job.py").read_text()
    fn, args, kwargs, _ = exported_job._load(job, "train")  # as run.sh loads it
    replayed = nbtrain.launch(fn, *args, devices=1, accelerator="cpu", progress=False, timeout=60, **kwargs)  # here
    assert replayed.metrics("lr") == result.metrics("lr")


@pytest.mark.slow
def test_a_fork_waits_until_a_watching_thread_is_between_messages():
    """A fork copies the locks its other threads hold, held for ever in the child: it waits for
    a background run's watching thread to stop drawing (`WATCHING`)."""
    holding, drawn = threading.Event(), []

    def draw():
        with WATCHING:
            holding.set()
            time.sleep(0.3)  # drawing: the kernel's stdout or the widgets' comm held
            drawn.append(True)

    watcher = threading.Thread(target=draw)
    watcher.start()
    holding.wait(10)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if drawn else 1)  # the child's copy of the draw: finished
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "forked in the middle of a draw"
    watcher.join(10)


# -- without processes -------------------------------------------------------------------------

def test_bad_input_is_refused_before_anything_starts():
    with pytest.raises(TypeError, match="wait='no'"):
        nbtrain.launch(train, devices=2, accelerator="cpu", wait="no")
    with pytest.raises(ValueError, match="runs the function in the kernel itself"):
        nbtrain.launch(train, devices=1, accelerator="cpu", wait=False)
    with pytest.raises(ValueError, match="restarts are not offered"):
        nbtrain.launch(train, devices=2, accelerator="cpu", wait=False, max_restarts=1)
    with pytest.raises(TypeError, match="give a steered run's changes"):
        nbtrain.export(train, to="/nonexistent/nbtrain-job", changes=["set lr=0.01"])  # nothing written
    ctx = Context()
    with pytest.raises(ValueError, match="needs the objects"):
        ctx.steer()
    with pytest.raises(ValueError, match="offered to run.call"):
        ctx.steer(step=3)


def test_a_rank_holds_at_the_target_step_and_reports_each_step_it_holds_at():
    """The rank side's state machine, driven as the listener thread and the main thread drive it."""
    said = []
    steering = Steering(0, said.append)

    def boundaries(count):
        for _ in range(count):
            steering.steps += 1
            if steering.pending and steering.at_boundary(True):
                return "stopped"
        return "ran"

    assert boundaries(3) == "ran" and not said  # nothing asked: nothing said
    steering.on_message(protocol.SteerHold(5))  # the agreed step is ahead: run on to it
    assert said == [protocol.SteerHeld(0, 3, held=False)]  # the listener's answer: 3 passed, inside the 4th
    main = threading.Thread(target=boundaries, args=(10,))
    main.start()
    deadline = time.monotonic() + 10
    while len(said) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said[1] == protocol.SteerHeld(0, 5) and main.is_alive()
    steering.on_message(protocol.SteerHold(6))  # moved on: hold one step later
    while len(said) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said[2] == protocol.SteerHeld(0, 6)
    steering.on_message(protocol.SteerApply(1, "stop"))
    while len(said) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said[3].seq == 1 and said[3].step == 6 and not said[3].error
    steering.on_message(protocol.SteerResume())
    main.join(10)
    assert not main.is_alive() and steering.steps == 6 and steering.stopping


def test_the_chart_and_the_summary_figure_mark_each_change_at_its_step():
    history = [protocol.Metric(s, 0, "loss", 1.0 / (s + 1), False) for s in range(20)]
    series = MetricSeries()
    series.consume(history)
    changes = [protocol.Change(8, "pause", "paused", 0.0), protocol.Change(8, "set", "set lr=0.01", 0.0),
               protocol.Change(12, "stop", "stopped", 0.0)]
    marks = re.findall(r'<g class="nbtrain-change"><title>([^<]*)</title><line x1="([\d.]+)"[^>]*/><text[^>]*>([^<]*)<',
                       chart_html(series, changes))
    x = [chart.LEFT + s / 19 * (chart.WIDTH - chart.LEFT - chart.RIGHT) for s in (8, 12)]  # steps 0..19 span the axis
    assert [(said, round(float(at)), label) for said, at, label in marks] == [
        ("step 8: paused; step 8: set lr=0.01", round(x[0]), "pause · set lr=0.01"), ("step 12: stopped", round(x[1]), "stop")]
    ax = metrics_figure(history, changes=changes).axes[0]  # the PNG a notebook keeps
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"] == [8, 12]
    assert [text.get_text() for text in ax.texts] == ["pause · set lr=0.01", "stop"]


# -- from a real Jupyter kernel --------------------------------------------------------------------

KERNEL_SETUP = '''
import time, torch, nbtrain
''' + CHILDREN + '''
def train():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.steer(model=model, optimizer=opt)
    for _ in ctx.progress(range(1_000_000)):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss)
        time.sleep(0.005)
    return model
'''


@pytest.mark.slow
def test_a_background_run_frees_the_kernel_and_a_later_ctrl_c_does_not_reach_it(kernel):
    _, _, error, _ = kernel.run(KERNEL_SETUP)
    assert error is None, error
    _, err, error, shown = kernel.run("run = nbtrain.launch(train, devices=2, accelerator='cpu', start='fork', "
                                      "wait=False)")
    assert error is None and "Traceback" not in err, (error, err)  # the cell ended while the ranks train
    assert shown, "the live view is drawn in the cell that started the run"
    assert kernel.value("run.done()") is False
    asked = kernel.client.execute("print('waiting', flush=True); time.sleep(120)")
    kernel.wait_for_output(asked, "waiting")
    kernel.manager.interrupt_kernel()  # the cell that runs gets the Ctrl-C; the run goes on
    while (reply := kernel.client.get_shell_msg(timeout=30))["msg_type"] != "execute_reply":
        pass
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert kernel.value("run.done()") is False
    # A second launch forks the kernel while the first is watched (and drawn) from its thread.
    assert kernel.value("nbtrain.launch(lambda: 7, devices=2, accelerator='cpu', start='fork').values") == [7, 7]
    step = kernel.value("run.pause()")
    deadline = time.monotonic() + 30
    while "nbtrain-change" not in kernel.value("run._display.snapshot()['chart']"):  # the live chart marks it
        assert time.monotonic() < deadline, "no mark on the live chart"
        time.sleep(0.2)
    assert kernel.value("run.call(lambda step: step)") == [step, step]
    assert kernel.value("run.stop()") >= step
    assert kernel.value("type(run.result(timeout=60).value).__name__, run.result().changes[-1].what") == \
        ("Linear", "stop")
    assert kernel.value("children()") == []


@pytest.mark.slow
def test_ctrl_c_during_a_pause_lets_every_rank_go_on(kernel):
    _, _, error, _ = kernel.run(KERNEL_SETUP + '''
def late():
    ctx = nbtrain.context()
    time.sleep(4)                     # no boundary yet: a pause waits here
    return sum(1 for _ in ctx.progress(range(5)))

run = nbtrain.launch(late, devices=2, accelerator='cpu', start='fork', wait=False, progress=False)
''')
    assert error is None, error
    asked = kernel.client.execute("print('pausing', flush=True); run.pause(timeout=60)")
    kernel.wait_for_output(asked, "pausing")
    time.sleep(0.5)
    kernel.manager.interrupt_kernel()
    while (reply := kernel.client.get_shell_msg(timeout=30))["msg_type"] != "execute_reply":
        pass
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # The hold was taken back: the ranks pass their boundaries and finish, rather than hold at the first.
    assert kernel.value("run.result(timeout=60).values") == [5, 5]
    assert kernel.value("children()") == []
