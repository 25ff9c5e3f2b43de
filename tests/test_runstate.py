"""Step rates are told by the ranks' own clocks, never by when their events reach the notebook.
A loop resumed at `initial` reads initial..total, and its rate counts only the steps done now."""
import io
import json
import time

import numpy as np
import pytest
import torch

import nbtrain
from nbtrain.common import protocol, runlog
from nbtrain.common.protocol import Progress
from nbtrain.display import widgets
from nbtrain.display.recorder import RunRecorder
from nbtrain.display.text import LineDisplay, rank_line
from nbtrain.display.vitals import latest, slowest
from nbtrain.notebook.run.runmodel import RunState
from nbtrain.rank.context import Context

CPU2 = {"devices": 2, "accelerator": "cpu", "start": "fork", "timeout": 120}


def test_events_that_arrive_together_keep_the_ranks_own_timing():
    state = RunState("x", [0, 1])
    # Both ranks ran 100 steps over 2 s of their own clocks (which need not agree); rank 1's
    # events reached the notebook in one late batch, rank 0's as they happened.
    for rank, offset in ((0, 1000.0), (1, -5.0)):
        for n in range(0, 101, 10):
            state.handle(Progress(rank, 0, "batch", n, 100, n == 100, offset + n / 50))
    assert state.ranks[0].step_rate == pytest.approx(50.0)
    assert state.ranks[1].step_rate == pytest.approx(50.0)
    now = time.monotonic()
    assert state.ranks[0].recent_rate(5.0, now) == pytest.approx(50.0)
    assert state.ranks[1].recent_rate(5.0, now) == pytest.approx(50.0)


def test_a_rank_that_stops_reporting_slows_down_in_the_live_rate():
    view = RunState("x", [0]).ranks[0]
    for n in range(0, 101, 10):  # 50 steps/s, arriving as they happen (no lag)
        view.count_steps(0, n, n - 10 if n else 0, n / 50, n / 50)
    assert view.recent_rate(5.0, now=2.0) == pytest.approx(50.0)
    assert view.recent_rate(5.0, now=2.5) == pytest.approx(50.0)  # silent a moment: batching, not a stall
    assert view.recent_rate(5.0, now=6.0) == pytest.approx(50 / 5.0)  # silent 4 s: its last 5 s held 50 steps


def _lock_step(steps: int):
    import torch
    import torch.distributed as dist

    ctx = nbtrain.context()
    ctx.start_group()
    if ctx.rank == 0:
        time.sleep(1.0)  # rank 0 sets up longer: rank 1 waits at the first all_reduce, not in every step
    for _ in ctx.progress(range(steps)):
        time.sleep(0.005 if ctx.rank == 0 else 0.02)  # rank 1 computes longer; all_reduce makes rank 0 wait
        dist.all_reduce(torch.ones(1))


def _straggler(seconds: float):
    ctx = nbtrain.context()
    pause = 0.05 if ctx.rank == 1 else 0.01  # no collective: rank 1 is truly slower
    for _ in ctx.progress(range(int(seconds / pause))):
        time.sleep(pause)


class _Kept(widgets.WidgetDisplay):
    """The live view, kept for a look after the run."""

    def finish(self, state, ok):
        self.state = state
        super().finish(state, ok)


def _live_rates(result) -> dict[int, float]:
    """Each rank's rate in the last vitals sample that has both."""
    times = sorted({v.time for v in result.vitals if v.step_rate is not None}, reverse=True)
    for at in times:
        rates = {v.rank: v.step_rate for v in result.vitals if v.time == at and v.step_rate is not None}
        if len(rates) == 2:
            return rates
    raise AssertionError(f"no sample with both ranks' rates: {result.vitals}")


@pytest.mark.slow
def test_lock_step_ranks_read_the_same_rate(no_leftovers):
    display = _Kept()
    result = nbtrain.launch(_lock_step, 120, progress=display, **CPU2)
    final = {r: v.step_rate for r, v in display.state.ranks.items()}
    live = _live_rates(result)
    for rates in (final, live):
        assert max(rates.values()) / min(rates.values()) < 1.3, rates
        assert slowest(rates) is None, rates
    assert "slowest" not in widgets.summary_html(display.state, True)


@pytest.mark.slow
def test_a_straggler_is_still_marked_slowest(no_leftovers):
    display = _Kept()
    result = nbtrain.launch(_straggler, 1.5, progress=display, **CPU2)
    final = {r: v.step_rate for r, v in display.state.ranks.items()}
    assert slowest(final) == 1 and slowest(_live_rates(result)) == 1, (final, result.vitals)
    assert final[0] / final[1] > 3  # 100 vs 20 steps/s
    rows = display.snapshot()["ranks"]
    assert "slowest" in rows[1]["vitals"] and "slowest" not in rows[0]["vitals"]
    assert set(latest(display.state)) == {0, 1}


# -- resumed loops: ctx.progress(..., initial=) ---------------------------------------------

class _Into:
    """A Context's sink that hands its events to a RunState, as an in-process run's does."""

    def __init__(self, state: RunState, rank: int = 0):
        self.state, self.rank, self.events = state, rank, []

    def emit(self, message):
        self.events.append(message)
        self.state.handle(message)


def test_a_resumed_loop_reads_from_initial_to_total_and_its_rate_counts_only_new_steps():
    state = RunState("x", [0])
    # 100 steps done before; 50 more over 1 s of the rank's clock: 50 steps/s, not 150.
    for n in range(100, 151, 5):
        state.handle(Progress(0, 0, "step", n, 150, n == 150, 7.0 + (n - 100) / 50, 100))
    view = state.ranks[0]
    bar = view.bars[0]
    assert (bar.n, bar.total, bar.initial) == (150, 150, 100)
    assert bar.rate == pytest.approx(50.0) and view.step_rate == pytest.approx(50.0) and view.steps == 50
    assert rank_line(view, state, final=True) == "rank 0  stopped (interrupted)  step 150/150  50 it/s"
    # The same loop begun again, resumed at 120 while its bar reads 150: a new bar, from 120.
    for n in (120, 130):
        state.handle(Progress(0, 0, "step", n, 150, False, 20.0 + (n - 120) / 50, 120))
    bar = view.bars[0]
    assert (bar.n, bar.initial, bar.started, bar.rate) == (130, 120, 20.0, pytest.approx(50.0))
    assert view.steps == 50 + 10
    midway = RunState("x", [0])
    for n in (100, 110, 125):
        midway.handle(Progress(0, 0, "step", n, 150, False, (n - 100) / 50, 100))
    assert midway.ranks[0].bars[0].eta == pytest.approx(0.5)  # 25 left at 50/s


def test_events_logged_before_initial_existed_still_begin_at_0():
    state = RunState("x", [0])  # a run directory written by an older nbtrain: six fields
    for n in range(0, 51, 10):
        state.handle(Progress(0, 0, "epoch", n, 50, n == 50, n / 50))
    bar = state.ranks[0].bars[0]
    assert (bar.n, bar.total, bar.initial) == (50, 50, 0) and bar.rate == pytest.approx(50.0)


def test_progress_takes_initial_and_refuses_what_is_not_a_count():
    state = RunState("x", [0])
    ctx = Context(sink=_Into(state))
    assert list(ctx.progress(range(7, 10), desc="step", initial=7)) == [7, 8, 9]
    bar = state.ranks[0].bars[0]
    assert (bar.n, bar.total, bar.initial, bar.done) == (10, 10, 7, True)  # total: initial + len
    list(ctx.progress(iter(range(3)), initial=2))  # no len: no total, as before
    assert (state.ranks[0].bars[0].n, state.ranks[0].bars[0].total) == (5, None)
    list(ctx.progress(range(3), total=20, initial=2))  # a total given is kept
    assert (state.ranks[0].bars[0].n, state.ranks[0].bars[0].total) == (5, 20)
    list(ctx.progress(range(3), initial=np.int64(2)))  # a step read back from a checkpoint
    assert state.ranks[0].bars[0].n == 5 and type(state.ranks[0].bars[0].n) is int
    for bad in (-1, 1.5, True, "3", None, torch.tensor(-2)):
        with pytest.raises(ValueError, match=r"^ctx.progress\(initial=.*\): initial must be an int >= 0 "):
            ctx.progress(range(3), initial=bad)  # at the call, not at the first step


def test_nested_resumed_loops_still_nest():
    state = RunState("x", [0])
    sink = _Into(state)
    ctx, seen = Context(sink=sink), []
    for epoch in ctx.progress(range(1, 3), desc="epoch", initial=1):
        start = 4 if epoch == 1 else 0  # resumed mid-epoch, then whole epochs
        for _ in ctx.progress(range(start, 6), desc="batch", initial=start):
            bars = state.ranks[0].bars
            seen.append((bars[0].n, bars[1].n, bars[1].total))
    view = state.ranks[0]
    assert seen[0] == (1, 4, 6) and seen[2][1:] == (0, 6)  # each loop starts where it resumed
    assert [(b.desc, b.n, b.total) for _, b in sorted(view.bars.items())] == [("epoch", 3, 3), ("batch", 6, 6)]
    assert view.step_level == 1 and view.steps == 2 + 6  # the batches done now, not the 4 before
    assert [e.level for e in sink.events if isinstance(e, Progress)][:2] == [0, 1]


def test_a_recorded_resumed_loop_replays_as_it_ran(tmp_path):
    """A submitted run's recorder writes a loop's first event at once (it says where the loop
    starts) and `attach` replays the log into the same bar."""
    recorder, state = RunRecorder(tmp_path, 0), RunState("x", [0])
    recorder.start(state)
    for n in range(4):  # a first loop here, then the same loop resumed at 30, all within a second:
        state.handle(Progress(0, 0, "step", n, 3, n == 3, float(n), 0))
    for n in range(30, 41):  # each loop's first event and its end are written, no other
        state.handle(Progress(0, 0, "step", n, 40, n == 40, float(n), 30))
    recorder.finish(state, True)
    recorder.close()
    logged = [event for _, event in runlog.Tail(tmp_path / runlog.rank_events(0)).read()
              if isinstance(event, Progress)]
    assert [e.n for e in logged] == [0, 3, 30, 40]
    replayed = RunState("x", [0])
    for event in logged:
        replayed.handle(event)
    assert replayed.ranks[0].bars[0] == state.ranks[0].bars[0]
    assert replayed.ranks[0].steps == state.ranks[0].steps == 3 + 10


def _resumed(pause: float):
    """Epoch 1 of 3 and batch 10 of 40 were done before: 30 + 40 batches are done now."""
    ctx = nbtrain.context()
    for epoch in ctx.progress(range(1, 3), desc="epoch", initial=1):
        start = 10 if epoch == 1 else 0
        for _ in ctx.progress(range(start, 40), desc="batch", initial=start):
            time.sleep(pause)


class _Watched(LineDisplay):
    """The text display, keeping the state and every position a rank's bars held."""

    def start(self, state):
        self.state, self.seen = state, []

        def heard(event):
            if isinstance(event, Progress) and event.rank == 0:
                self.seen.append({lv: (b.n, b.total) for lv, b in state.ranks[0].bars.items()})

        state.subscribe(heard)
        super().start(state)


@pytest.mark.slow
def test_a_resumed_launch_reads_initial_to_total_and_counts_only_new_steps(no_leftovers):
    pause, out = 0.02, io.StringIO()
    display = _Watched(file=out, interval=3600)
    result = nbtrain.launch(_resumed, pause, progress=display, **CPU2)
    assert display.seen[0] == {0: (1, 3)}  # the epoch bar begins at 1 of 3, never at 0
    assert display.seen[1] == {0: (1, 3), 1: (10, 40)}
    assert {b[1] for s in display.seen for b in s.values()} == {3, 40}
    summary = out.getvalue()
    for rank, view in display.state.ranks.items():
        assert view.steps == 30 + 40, view
        assert f"rank {rank}  finished  epoch 3/3 batch 40/40" in summary
    # Each batch sleeps `pause`: no rate of steps done now can exceed 1/pause (counting the 10
    # batches done before would).
    rates = [v.step_rate for v in display.state.ranks.values()]
    rates += [v.step_rate for v in result.vitals if v.step_rate is not None]
    assert rates and all(0 < r <= 1 / pause for r in rates if r is not None), rates


# -- the model's observers ------------------------------------------------------------------------

def test_observers_hear_every_change_and_its_replay_rebuilds_the_same_run():
    """What a submitted run's recorder hears is all `attach` needs: the events, fed to a new
    state, give the same statuses, blame and metrics."""
    from nbtrain.common.protocol import Failed, Finished, Hello, Metric, Raised, Returned, Stopped
    from nbtrain.common.transfer import pack_result

    state, heard = RunState("ddp on 3 CPU ranks, gloo", [0, 1, 2]), []
    state.subscribe(heard.append)
    for rank in (0, 1, 2):
        state.handle(Hello(rank, 100 + rank, "node"))
    state.handle(Progress(0, 0, "batch", 3, 10, False, 1.0))
    state.handle(Metric(0, 0, "loss", 0.5, False))
    state.handle(Metric(0, 0, ("a", 1), 2.0, False))  # a name that is not a str: a JSON list in the log
    state.handle(Raised(2, "RuntimeError: Connection closed by peer", "gloo ..."))  # only a lost peer
    state.fail(1, "rank 1 ended: killed by SIGKILL", crashed=True)  # the cause
    state.fail(1, "said twice", crashed=True)  # no change: not heard
    state.handle(Returned(0, pack_result(7, 0), "returned from train()"))
    assert [type(e) for e in heard] == [Hello, Hello, Hello, Progress, Metric, Metric, Failed, Failed, Finished]
    assert heard[-1] == Finished(0, "returned from train()") and heard[6].summary.startswith("RuntimeError")

    replayed = RunState("ddp on 3 CPU ranks, gloo", [0, 1, 2])
    for event in heard:  # through a log, as attach reads it
        [(_, event)] = [protocol.read_event(json.loads(protocol.event_line(0, event)), protocol.VERSION)]
        replayed.handle(event)
    for state_ in (state, replayed):
        assert [state_.outcome(r, final=True)[:2] for r in (0, 1, 2)] == [
            ("finished", ""), ("failed", "rank 1 ended: killed by SIGKILL"), ("stopped", "stopped (rank 1 failed)")]
        assert state_.root_cause().rank == 1 and state_.verdict(False) == "failed"
        assert state_.ranks[0].metrics["loss"].value == 0.5 and state_.ranks[0].metrics[("a", 1)].value == 2.0
        assert state_.ranks[2].pid == 102
    assert state.values == {0: 7} and replayed.values == {0: None}  # a replay's values are in result.pkl

    running = RunState("x", [0])
    running.subscribe(heard.append)
    running.stop(0, "interrupted", "stack")
    assert heard[-1] == Stopped(0, "interrupted", "stack") and running.outcome(0, final=True)[0] == "stopped"
