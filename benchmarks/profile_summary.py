"""What a profile's window costs a rank, and its summary's time against the number of steps, before/after.

One process records torch.profiler (CPU) over a window of N steps of the small MLP of
insight_overhead.py (forward, backward, SGD step), as a rank does for `profile=Profile(steps=N)`,
then summarises the window's events with `nbtrain.rank.profiling.summarize` twice, interleaved:
as it is now (each operator's steps found by bisection) and as it was before (each operator
compared with every step: time quadratic in the steps). Windows past nbtrain's maximum
(`MAX_STEPS`) are recorded here directly, to show why there is one. Reported per window: the
rank's memory growth (the recording and the Python objects of its events), the time of torch's own
`events()`, and the summary's median time before and after.

Then what the largest window costs a whole run: a 2-rank CPU launch (ddp_fork, DDP) of 120 steps
with and without `profile=Profile(steps=MAX_STEPS)`, interleaved: the launch's wall time and
how much each rank's peak resident memory grew during its run.

    python benchmarks/profile_summary.py [--steps 25 50 100 300 1000 2000] [--repeats 3] [--no-save]
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbtrain  # noqa: E402
from _common import median, record, table  # noqa: E402
from nbtrain.rank import profiling  # noqa: E402


def _top_before(events, windows, count):
    """The summary's top operators as measured before this change: every event against every step."""
    totals: dict[str, float] = {}
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in windows)
        if inside > 0:
            totals[e.name] = totals.get(e.name, 0.0) + inside / 1e6
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:count]
    return [(name, seconds / len(windows)) for name, seconds in ranked]


def window(steps: int) -> tuple[list, float, float]:
    """A profiled window of `steps` steps: (its events, MB the process grew recording them and making
    them Python objects, s of events())."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    got = {}

    def ready(profiler):
        started = time.perf_counter()
        got["events"] = profiler.events()
        got["events_s"] = time.perf_counter() - started
        got["grown"] = (psutil.Process().memory_info().rss - rss) / 2**20  # the recording and its events

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], on_trace_ready=ready,
                                      schedule=torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1))
    rss = psutil.Process().memory_info().rss
    profiler.start()
    for _ in range(steps + 2):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        profiler.step()
    profiler.stop()
    return got["events"], got["grown"], got["events_s"]


def timed_summary(events, top) -> float:
    now, profiling._top = profiling._top, top
    try:
        started = time.perf_counter()
        summary = profiling.summarize(events)
        elapsed = time.perf_counter() - started
    finally:
        profiling._top = now
    assert summary["steps"] > 0
    return elapsed


def ddp_steps(steps: int) -> float:
    """A rank's part of the launch: DDP steps of the same MLP; returns how much its peak memory grew
    over what it had at the start (MB). The window's summary is made at the step that ends it."""
    start = psutil.Process().memory_info().rss / 2**20
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    for _ in ctx.progress(range(steps)):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("loss", loss)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start


def whole_runs(repeats: int) -> list[list[str]]:
    variants = {"no profile": None, f"Profile(steps={profiling.MAX_STEPS})": nbtrain.Profile(steps=profiling.MAX_STEPS)}
    found = {v: {"wall": [], "rss": []} for v in variants}
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as runs:
        for repeat in range(repeats):
            for name, profile in variants.items():
                started = time.perf_counter()
                result = nbtrain.launch(ddp_steps, profiling.MAX_STEPS + 20, devices=2, accelerator="cpu",
                                        strategy="ddp_fork", progress=False, profile=profile,
                                        run_dir=f"{runs}/{repeat}-{len(found[name]['wall'])}-{profile is None}")
                found[name]["wall"].append(time.perf_counter() - started)
                found[name]["rss"].append(max(result.values))
    return [[name, f"{median(v['wall']):.2f}", f"{median(v['rss']):.0f}",
             ", ".join(f"{w:.2f}" for w in v["wall"])] for name, v in found.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100, 300, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    launches = whole_runs(args.repeats)  # first: a forked rank starts with what this process holds
    rows = []
    for steps in args.steps:
        events, grown, events_s = window(steps)
        before, after = [], []
        for _ in range(args.repeats):  # interleaved
            before.append(timed_summary(events, _top_before))
            after.append(timed_summary(events, profiling._top))
        b, a = median(before), median(after)
        rows.append([f"{steps}" + (" (over the maximum)" if steps > profiling.MAX_STEPS else ""), f"{len(events):,}",
                     f"{grown:.0f}", f"{events_s:.2f}", f"{b:.3f}", f"{a:.3f}", f"{b / a:.1f}x"])
        print(rows[-1], flush=True)
        del events
    body = (f"torch.profiler (CPU) over N steps of a small MLP (64-256-10, batch 64, SGD) in one process, torch "
            f"{torch.__version__}; the window's summary (`profiling.summarize`) timed {args.repeats} times each way, "
            f"interleaved, median. Before: each operator compared with every step; after: its steps found by "
            f"bisection. nbtrain refuses windows over `MAX_STEPS` = {profiling.MAX_STEPS} (`Profile(steps=...)`); "
            "larger ones are recorded here directly to show the growth.\n\n"
            + table(["steps", "events", "memory grown (MB)", "torch events() s",
                     "summary before s", "summary after s", "speed-up"], rows)
            + "\n\nThe largest window in a whole run: a 2-rank CPU launch (ddp_fork, DDP) of "
            f"{profiling.MAX_STEPS + 20} steps, {args.repeats} interleaved repeats, median; memory: how much the "
            "larger rank's peak (its own "
            "ru_maxrss) grew over what it had at the start.\n\n"
            + table(["variant", "wall s", "peak memory growth per rank (MB)", "runs (wall s)"], launches))
    if args.no_save:
        print(body)
    else:
        record("Profile summary against the window (profile_summary.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
