"""Step rates are told by the ranks' own clocks, never by when their events reach the notebook."""
import time

import pytest

import nbtrain
from nbtrain.display import widgets
from nbtrain.display.runstate import RunState
from nbtrain.display.vitals import latest, slowest

CPU2 = {"devices": 2, "accelerator": "cpu", "strategy": "ddp_fork", "timeout": 120}


def test_events_that_arrive_together_keep_the_ranks_own_timing():
    state = RunState("x", [0, 1])
    # Both ranks ran 100 steps over 2 s of their own clocks (which need not agree); rank 1's
    # events reached the notebook in one late batch, rank 0's as they happened.
    for rank, offset in ((0, 1000.0), (1, -5.0)):
        for n in range(0, 101, 10):
            state.handle(("progress", rank, 0, "batch", n, 100, n == 100, offset + n / 50))
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
