"""What the profile's look at the user's own lines costs a profiled step, with and without it.

While a profile's window records, a thread reads the rank's main thread's stack every
`profiling.SAMPLE_EVERY` s (`StackSampler`), so the summary can name the user's lines where the
time outside operators went. This measures, in one process:

- one look: `sys._current_frames()` and the walk to the innermost frame of the user's own code,
  from the sampling thread, with the main thread waiting N frames deep in library code (`--depth`);
- a profiled step with the sampler and without it (its `start` made a no-op), interleaved, for
  three kinds of step: a small MLP's training step (torch operators), a pure-Python loop (the case
  where the sampler's thread competes for the GIL) and a sleep (a straggler's). Each run records a
  window of `--steps` steps with `Recorder` as a rank does for `profile=Profile(steps=N)`; the
  step time is the window's wall time over its steps.

    python benchmarks/profile_sampler.py [--steps 100] [--repeats 7] [--every 0.005] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbtrain  # noqa: E402
from _common import median, record, table  # noqa: E402
from nbtrain.rank import profiling  # noqa: E402


def look_cost(depth: int, looks: int = 2000) -> float:
    """Microseconds per look from another thread, the main thread waiting `depth` frames deep in
    library code under the user's own frame (the walk passes every one of them)."""
    # Frames compiled under the standard library's path count as library code, as torch's would.
    library_file = os.path.join(os.path.dirname(json.__file__), "nbtrain_bench_frames.py")
    space: dict = {}
    exec(compile("def down(n, done):\n    return down(n - 1, done) if n else done.wait()\n", library_file, "exec"),
         space)
    done, took = threading.Event(), []

    def sampler(thread_id):
        while len(took) * 100 < looks:
            started = time.perf_counter_ns()
            for _ in range(100):
                frame = sys._current_frames().get(thread_id)
                place = profiling.user_place(frame)
                del frame
            took.append((time.perf_counter_ns() - started) / 100)
        assert place is not None and place[2] == "look_cost", place  # the walk reached this function
        done.set()

    thread = threading.Thread(target=sampler, args=(threading.get_ident(),))
    thread.start()
    space["down"](depth, done)
    thread.join()
    return median(took) / 1000


def mlp_step(state):
    model, opt, x, y = state
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def python_step(_state):
    total = 0
    for i in range(40_000):
        total += i % 7
    return total


def sleep_step(_state):
    time.sleep(0.002)


STEPS = {"MLP 64-256-10, batch 64": mlp_step, "pure-Python loop": python_step, "time.sleep(0.002)": sleep_step}


def profiled_step(step, state, steps: int, sampled: bool, out_dir: str) -> float:
    """Seconds per step of a profiled window of `steps` steps (after 2 skipped, as Profile(steps=) does)."""
    settings = nbtrain.Profile(steps=steps)
    recorder = profiling.Recorder(settings, 0, torch.device("cpu"), out_dir)
    if not sampled:
        recorder.sampler.start = lambda: None  # type: ignore[method-assign]  # the variant without it
    recorder.start()
    marks = {}
    for n in range(settings.window.stop):
        if n in (settings.window.start, settings.window.stop - 1):
            marks[n] = time.perf_counter()
        step(state)
        recorder.step()
    recorder.stop()
    assert recorder.summary and recorder.summary["steps"] == steps
    assert bool(recorder.sampler.samples) == sampled
    return (marks[settings.window.stop - 1] - marks[settings.window.start]) / (steps - 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--every", type=float, default=profiling.SAMPLE_EVERY, help="seconds between looks")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    profiling.SAMPLE_EVERY = args.every
    torch.set_num_threads(1)
    look = look_cost(args.depth)
    print(f"one look, {args.depth} frames deep: {look:.1f} us", flush=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    state = (model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(64, 64), torch.randint(0, 10, (64,)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as out:
        for name, step in STEPS.items():
            step(state)  # warm
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):  # interleaved
                for sampled in (False, True):
                    times[sampled].append(profiled_step(step, state, args.steps, sampled, out))
            off, on = median(times[False]), median(times[True])
            rows.append([name, f"{off * 1000:.3f}", f"{on * 1000:.3f}", f"{(on / off - 1) * 100:+.1f} %",
                         ", ".join(f"{t * 1000:.2f}" for t in times[False]),
                         ", ".join(f"{t * 1000:.2f}" for t in times[True])])
            print(rows[-1], flush=True)
    body = (f"One process, torch {torch.__version__}, one intra-op thread; a look every "
            f"{profiling.SAMPLE_EVERY * 1000:g} ms while the window records. One look (`sys._current_frames()` and "
            f"the walk to the user's innermost frame, from the sampling thread, the main thread waiting {args.depth} "
            f"frames deep in library code): **{look:.1f} us**, median of 20 rounds of 100. "
            f"A profiled window of {args.steps} steps recorded by `Recorder` as a rank does, with the sampler and "
            f"without it, {args.repeats} interleaved repeats, median ms per step:\n\n"
            + table(["step", "without (ms)", "with the sampler (ms)", "difference", "runs without", "runs with"],
                    rows))
    if args.no_save:
        print(body)
    else:
        record("The profile's look at the user's own lines (profile_sampler.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
