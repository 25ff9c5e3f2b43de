"""What the default live view costs a short launch, in a real Jupyter kernel, 2 CPU ranks, fork.

`nbtrain.launch(fn, devices=2, accelerator="cpu", start="fork")` with the default view (widgets
in a kernel) against the same launch with `progress=False`, interleaved, median of many; `fn`
either returns at once or runs 5 steps under `ctx.progress` with a logged metric (so the view
has bars and a chart to draw). The difference is the view's cost; the goal is <= 10% of the
quiet launch. On a shared machine that difference of two noisy medians is itself noisy, so the
view is also timed alone: the default display's start, one update and finish for a 2-rank run
without a loop, in the same kernel (its widgets' messages really sent), median of 20 a round.
`--before DIR` times another checkout too (`git archive <commit> | tar -x -C DIR`), in a second
kernel, interleaved.

    python benchmarks/live_view.py [--rounds 30] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import os, statistics, time, nbtrain, torch
from nbtrain.common.protocol import Hello
from nbtrain.display import make_display
from nbtrain.notebook.run.runmodel import RunState

def empty():
    return nbtrain.context().rank

def steps():
    ctx = nbtrain.context()
    for i in ctx.progress(range(5), desc="step"):
        ctx.log("loss", 1.0 / (i + 1))
    return ctx.rank

def timed(fn, progress):
    t = time.perf_counter()
    nbtrain.launch(fn, devices=2, accelerator="cpu", start="fork", progress=progress)
    return time.perf_counter() - t

def view_alone():
    state = RunState("ddp_fork on 2 CPU ranks, gloo", [0, 1])
    for rank in (0, 1):
        state.handle(Hello(rank, os.getpid()))
    t = time.perf_counter()
    display = make_display(True)
    display.start(state)
    display.update(state)
    for rank in (0, 1):
        state.finish(rank, rank)
    display.finish(state, True)
    return time.perf_counter() - t

for _ in range(3):  # warm: the first fork imports what ranks need, the first view ipywidgets
    timed(steps, True); timed(steps, False)
'''

CASES = {"returns at once": "empty", "5 steps, a bar and a metric": "steps"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--before", help="another checkout of nbtrain: timed too, in a second kernel")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    kernels = {"": Kernel()}
    try:
        if args.before:
            path = os.path.abspath(args.before)
            kernels[" (before)"] = Kernel(cwd=path, env={**os.environ, "PYTHONPATH": path})
        for kernel in kernels.values():
            kernel.run(SETUP)
        times: dict[tuple, list[float]] = {}
        for _ in range(args.rounds):
            for case, fn in CASES.items():
                for tag, kernel in kernels.items():
                    for progress in ("False", "True"):
                        out = kernel.run(f"print(timed({fn}, {progress}))")
                        times.setdefault((case, tag, progress), []).append(float(out.split()[-1]))
            for tag, kernel in kernels.items():
                out = kernel.run("print(statistics.median(view_alone() for _ in range(20)))")
                times.setdefault(("alone", tag, ""), []).append(float(out.split()[-1]))
    finally:
        for kernel in kernels.values():
            kernel.close()
    rows = []
    for case in CASES:
        for tag in kernels:
            quiet, shown = median(times[(case, tag, "False")]), median(times[(case, tag, "True")])
            rows.append([f"{case}{tag}", f"{quiet * 1000:.1f} ms", f"{shown * 1000:.1f} ms",
                         f"{(shown - quiet) * 1000:.1f} ms", f"{(shown - quiet) / quiet:.0%}", str(args.rounds)])
    for tag in kernels:
        quiet, alone = median(times[("returns at once", tag, "False")]), median(times[("alone", tag, "")])
        rows.append([f"the view alone (start, update, finish; no loop){tag}", "", "", f"{alone * 1000:.1f} ms",
                     f"{alone / quiet:.0%}", f"{args.rounds} x 20"])
    body = table(["2 CPU ranks, fork, warm kernel", "progress=False", "default view (widgets)", "view costs",
                  "of the quiet launch", "rounds"], rows)
    record("Live view cost (live_view.py)", body + "\n\nGoal: the default view costs <= 10% of the quiet launch."
           + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
